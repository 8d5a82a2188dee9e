"""Long prompts read in a second context with an F16/F16 cache, and their cells moved
into the target's sequence 0 after the first token is out.

- The **F16 context**: llama.cpp's tiled attention kernel reads a long prompt faster
  there than in the target's Q8_0 cache (``engine.runtime.kv_transfer`` says why the
  cells can move).
- The **prefill copy**: where the target's own weight layout is the slower one for
  prompts, a second copy of the weights in the faster layout prefills there
  (``engine.runtime.prompt_weights``).
- The **move buffer** the cells travel through, made when the target opens.

The moved cells join sequence 0 as a pending move (``CachedSequence.append_pending``):
this class is the ``PendingMove`` the sequence asks for them when it settles. Figures
behind the thresholds: docs/benchmarks.md ("Reading prompts").
"""

from __future__ import annotations

import logging
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from engine.errors import ContextFullError, ModelLoadError, NativeError
from engine.gguf.header import read_file_facts
from engine.runtime.kv_cache import kv_bytes_per_token
from engine.runtime.kv_transfer import (
    StateFormatError,
    f16_to_q8_0_keys,
    llama_rotates_quantized_k,
)
from engine.runtime.native import (
    NativeContext,
    NativeModel,
    prompt_kernels,
    prompt_kernels_available,
)
from engine.runtime.prompt_weights import prompts_prefer_repacked
from engine.runtime.sequences import common_prefix_length

if TYPE_CHECKING:
    from engine.runtime.architecture import ArchitectureFacts
    from engine.runtime.native import NativeBatch
    from engine.runtime.sequence import CachedSequence
    from engine.runtime.target_config import TargetConfig

log = logging.getLogger(__name__)

# Shortest run of prompt tokens worth prefilling in the F16 context: llama.cpp's tiled
# attention kernel needs 64 queries in a batch, and below ~100 tokens attention is too
# small a share of the prefill to repay moving the cells.
F16_PREFILL_MIN_TOKENS = 128
# With a copy of the weights in the faster prompt layout the F16 context is where the
# fast kernels are: below this few tokens the cell move is not repaid.
F16_COPY_MIN_TOKENS = 16
# At most 1/F16_MAX_REDO_SHARE of a prompt's new tokens may be tokens this cache holds
# but the F16 context would evaluate again; past that, prefilling here is sooner.
F16_MAX_REDO_SHARE = 4
# The largest buffer a long prompt's cell move keeps for the next one (a 1.7B shape's
# ~800-token prompt is 100 MB); longer prompts' moves allocate theirs each time.
MOVE_BUFFER_KEPT = 256 * 2**20
# Prompt tokens the move's buffer is made for when the target opens (rag prompts are
# 660-790 tokens).
MOVE_PREFAULT_TOKENS = 1024


def fast_prompts(config: TargetConfig) -> bool:
    """Whether prompts are read with the prompt kernels (asked for, and built in)."""
    return config.prompt_kernels and prompt_kernels_available()


class F16Prefill:
    """The F16 context of one target (see the module docstring)."""

    def __init__(self, model: NativeModel, path: Path, arch: ArchitectureFacts,
                 config: TargetConfig, sequence: CachedSequence, batch: NativeBatch,
                 n_threads: int, n_gpu_layers: int) -> None:
        """Opens the F16 context where it applies: made now, not on the first long
        prompt, whose first token would wait for it."""
        self.model, self.path, self.arch, self.config = model, path, arch, config
        self.sequence, self.batch = sequence, batch
        self.n_gpu_layers = n_gpu_layers
        self.ctx: NativeContext | None = None
        self.tokens: list[int] = []  # what the F16 context's sequence 0 holds
        self.prefill_model: NativeModel | None = None  # the prefill copy, if one is made
        self.move_buffer: np.ndarray | None = None
        self.off = self._why_not()
        if self.off:
            return
        try:
            self.ctx = NativeContext(
                self._open_prefill_model(), n_ctx=sequence.ctx.n_ctx,
                n_batch=config.n_batch, n_seq_max=2, n_threads=n_threads,
                features=False, type_k="f16", type_v="f16",
                # V laid out as the target's (transposed without flash attention)
                flash_attn=sequence.ctx.flash_attn)
        except ModelLoadError as exc:
            self.off = f"no memory for it: {exc}"
            log.warning("F16 prefill off, prompts are prefilled in the Q8_0 cache: %s", exc)
        else:
            try:
                self._prefault_move_buffer()
            except BaseException:
                self.close()
                raise

    def close(self) -> None:
        for handle in (self.ctx, self.prefill_model):
            if handle is not None:
                handle.close()
        self.ctx = self.prefill_model = None

    def set_off(self, why: str | None) -> None:
        """Off, saying why, or on again (None)."""
        self.off = why

    def clear(self) -> None:
        """Forget the prompts read here (a benchmark's cold start)."""
        if self.ctx is not None:
            self.ctx.kv_clear()
            self.tokens = []

    def set_threads(self, n_threads: int) -> None:
        if self.ctx is not None:
            self.ctx.set_n_threads(n_threads)

    def set_feature_layers(self, layers: tuple[int, ...]) -> None:
        if self.ctx is not None:
            self.ctx.set_feature_layers(layers)

    def set_next_features(self, on: bool) -> None:
        if self.ctx is not None:
            self.ctx.set_next_features(on)

    # --- prefilling -------------------------------------------------------------------
    def _why_not(self) -> str | None:
        c = self.config
        if not c.f16_prefill:
            return "turned off"
        if self.arch.why_no_cell_move:
            return self.arch.why_no_cell_move
        if c.type_k != "q8_0" or c.type_v != "f16":
            return f"the cache is {c.type_k}/{c.type_v}, not Q8_0/F16"
        if not c.unified_kv:
            return "needs one KV stream"
        if self.n_gpu_layers:
            return "layers run on a GPU"
        if c.workers:
            return "layers run on workers (the cell move would cross the network twice)"
        if not self.sequence.ctx.flash_attn and self.copy_layout is None:
            # Without flash attention a prompt goes through the matrix kernels in either
            # cache, and the target's reads it as fast with no cells to move after it
            # (docs/benchmarks.md: long contexts; the move of 8k tokens took 100-160 ms).
            return "without flash attention the target's own cache reads prompts as fast"
        return None

    @cached_property
    def copy_layout(self) -> bool | None:
        """The layout (repacked or not) of a copy of the weights prompts would prefill
        faster with (``TargetConfig.prefill_copy``), None when the target's own serve
        (worked out once: it reads the file's tensor table and the free memory)."""
        c = self.config
        if not c.prefill_copy:
            return None
        # Without the prompt kernels only repacking speeds a prompt up.
        repack = prompts_prefer_repacked(self.path) if fast_prompts(self.config) else True
        if repack is None or repack == c.repack:
            return None
        if repack and not _room_for_a_copy(self.path):  # plain weights are mmapped
            return None
        return repack

    def _open_prefill_model(self) -> NativeModel:
        """The weights the F16 context prefills with: the target's own, or a copy in the
        layout its prompts prefill fastest with (``copy_layout``)."""
        repack = self.copy_layout
        if repack is None:
            return self.model
        try:
            self.prefill_model = NativeModel(self.path, repack=repack)
        except ModelLoadError as exc:
            log.warning("prompts are prefilled with the target's own weights: %s", exc)
            return self.model
        return self.prefill_model

    def prefill(self, tokens: list[int], n_features: int
                        ) -> tuple[np.ndarray, np.ndarray] | None:
        """Append ``tokens`` to sequence 0 by prefilling them in the F16 context and
        moving their cells here. Returns the last token's logits and the hidden states of
        the last ``n_features`` tokens ([0, n_embd] when none are asked), or None (nothing
        changed) when it does not apply or fails; a failure turns it off for this target,
        with a warning."""
        seq = self.sequence
        shortest = (F16_COPY_MIN_TOKENS if self.prefill_model is not None
                    else F16_PREFILL_MIN_TOKENS)
        if self.off or len(tokens) < shortest:
            return None
        # The F16 context holds the prompts it prefilled, not the answers decoded here:
        # a chat's next turn would evaluate the last answer there again.
        full = seq.tokens + tokens
        start = self._f16_start(full)
        if (seq.n_past - start) * F16_MAX_REDO_SHARE > len(tokens):
            return None
        try:
            return self._prefill_f16_and_move(full, start, n_features)
        except (NativeError, StateFormatError, ContextFullError) as exc:
            seq.drop_uncommitted()
            self._turn_off(exc)
            return None

    def _turn_off(self, exc: Exception) -> None:
        self.off = f"failed: {exc}"
        log.warning("F16 prefill off, prompts are prefilled in the Q8_0 cache: %s", exc)
        self.close()

    def _prefill_f16_and_move(self, full: list[int], start: int, n_features: int
                              ) -> tuple[np.ndarray, np.ndarray]:
        """Evaluate ``full`` (the committed tokens, then the new ones) from ``start`` in
        the F16 context; its new tokens become committed here, their cells moved later."""
        seq = self.sequence
        # The last prompt's cells leave first; a failed move closes the F16 context, so
        # it is looked up after.
        seq.settled()
        f16 = self.ctx
        if f16 is None:  # made with the target; dropped only when turned off
            raise NativeError("F16 prefill context", 0, "closed")
        # Features are evaluated again beside the prompt (sequence 1): asked of sequence
        # 0's chunks they would make every token an output (the LM head over the whole
        # prompt) and change the last token's logits. The prompt leaves at least one cell
        # free, so at least the last token's fit.
        n_features = min(n_features, self.sequence.ctx.n_ctx - len(full))
        step = self.config.n_batch
        f16.kv_remove(0, start, -1)
        del self.tokens[start:]
        with prompt_kernels(self.config.prompt_kernels):
            for pos0 in range(start, len(full), step):
                chunk = full[pos0:pos0 + step]
                outputs = [False] * len(chunk)
                outputs[-1] = pos0 + len(chunk) == len(full)
                self.batch.fill(chunk, list(range(pos0, pos0 + len(chunk))), None, outputs)
                f16.decode(self.batch)
                self.tokens.extend(chunk)
            logits = f16.logits(1)[0]  # read back before the kernels change
        feats: np.ndarray | None = np.empty((0, self.sequence.ctx.feature_width),
                                            dtype=np.float32)
        if n_features > 0:
            try:
                feats = self._f16_features_again(f16, full, n_features)
            except (NativeError, ContextFullError) as exc:
                # The prompt was read as plain decoding reads it; only a drafter's
                # features failed. F16 prefill stays on: off in a drafted session alone,
                # its later prompts would be read otherwise than plain decoding's.
                log.warning("a prompt's features were not evaluated in the F16 context "
                            "(%s): evaluated over the moved cells", exc)
                feats = None
        # The cells move when the sequence next settles: the first token does not wait
        # for the copy and the K conversion.
        seq.append_pending(full[seq.n_past:], self)
        if feats is None:
            feats = self._features_over_moved_cells(n_features)
        return logits, feats

    def _features_over_moved_cells(self, n_features: int) -> np.ndarray:
        """The last ``n_features`` tokens' hidden states evaluated in the target's own
        cache (its cells moved first); none when that fails too (the drafter then
        drafts from fewer)."""
        try:
            return self.sequence.features_again(n_features)
        except (NativeError, ContextFullError) as exc:
            log.warning("a prompt's features were not evaluated: %s", exc)
            return np.empty((0, self.sequence.ctx.feature_width), dtype=np.float32)

    def _f16_start(self, full: list[int]) -> int:
        """Where the F16 context's evaluation of ``full`` starts. Chunks start at
        multiples of n_batch, so the cells a prompt gets do not depend on which earlier
        prompt left how much in this context, nor on features asked. The last chunk is
        evaluated even when cached: its logits choose the first token."""
        step = self.config.n_batch
        n_same = common_prefix_length(self.tokens, full)
        return min(n_same - n_same % step, (len(full) - 1) // step * step)

    def _f16_features_again(self, f16: NativeContext, full: list[int], n_features: int
                            ) -> np.ndarray:
        """Hidden states of the last ``n_features`` tokens of ``full`` (all in sequence
        0 of the F16 context), evaluated again in sequence 1 on sequence 0's cells
        before them; sequence 1 is emptied after."""
        batch = self.batch
        first = len(full) - n_features
        step = self.config.n_batch
        f16.kv_copy(0, 1, 0, first)  # shares the cells, copies nothing
        f16.set_features(True)
        try:
            feats = []
            for pos0 in range(first, len(full), step):
                chunk = full[pos0:pos0 + step]
                batch.fill(chunk, list(range(pos0, pos0 + len(chunk))),
                           [(1,)] * len(chunk), True)
                f16.decode(batch)
                feats.append(f16.features(len(chunk)))
            return np.concatenate(feats)
        finally:
            f16.set_features(False)
            f16.kv_remove(1, -1, -1)

    # --- the cell move (the sequence's PendingMove) ---------------------------------------
    def cells_from(self, start: int, end: int) -> np.ndarray:
        """The F16 context's cells of positions [start, end), their K converted to Q8_0:
        the state blob sequence 0 takes when it settles."""
        f16 = self.ctx
        if f16 is None:  # turned off since: the sequence evaluates them itself
            raise NativeError("F16 prefill context", 0, "closed")
        # Sequence 1 is free outside a verification: the cells travel through it.
        f16.kv_copy(0, 1, start, end)
        try:
            blob = f16.state_seq_array(1, into=self.move_buffer)
        finally:
            f16.kv_remove(1, -1, -1)
        self._keep_move_buffer(blob)
        return f16_to_q8_0_keys(blob, self.model.n_head_kv, llama_rotates_quantized_k())

    def holds(self, tokens: list[int]) -> bool:
        """Whether the F16 context's cells for ``tokens`` are still there (it went on
        from them, or holds more)."""
        return (not self.off and self.ctx is not None
                and common_prefix_length(self.tokens, tokens) == len(tokens))

    def move_failed(self, exc: Exception) -> None:
        """The move failed: F16 prefill is turned off (with a warning), and the sequence
        evaluates those tokens in the target's cache; the first token, already chosen,
        came from the F16 prefill's logits."""
        self._turn_off(exc)

    def _prefault_move_buffer(self) -> None:
        """The move's buffer for a prompt of up to ``MOVE_PREFAULT_TOKENS`` tokens, its
        pages touched now, while the model opens: the first move in a process faulted it
        in before the answer's second token. Prompts of 16+ tokens take the move where
        weights are copied for prompts, so it is used at once."""
        tokens = min(self.sequence.ctx.n_ctx, MOVE_PREFAULT_TOKENS)
        # A cell's K and V rows in F16, and its position and sequence (12 bytes).
        per_token = kv_bytes_per_token(read_file_facts(self.path), self.path.stat().st_size,
                                       "f16", "f16") + 12
        size = min(MOVE_BUFFER_KEPT, int(per_token * tokens) + 4096)
        buffer = np.empty(size, dtype=np.uint8)
        buffer[::4096] = 0
        self.move_buffer = buffer

    def _keep_move_buffer(self, blob: np.ndarray) -> None:
        """Keep the move's buffer for the next move, up to ``MOVE_BUFFER_KEPT`` bytes: a
        fresh one is faulted in page by page."""
        base = blob.base if isinstance(blob.base, np.ndarray) else blob
        if base.nbytes <= MOVE_BUFFER_KEPT and (self.move_buffer is None or
                                                 base.nbytes > self.move_buffer.nbytes):
            self.move_buffer = base


def _room_for_a_copy(path: Path) -> bool:
    """Whether the memory free now holds a second copy of the weights with a margin."""
    import psutil

    size = path.stat().st_size
    return psutil.virtual_memory().available > 2 * size + 1024**3
