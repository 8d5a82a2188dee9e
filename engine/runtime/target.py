"""The target model: a GGUF run by llama.cpp, with a KV cache Tandem keeps in step.

The target keeps verification and decoding. Sequence 0 of the KV cache holds ``tokens``
(positions 0..n_past-1) and has one owner, ``engine.runtime.sequence.CachedSequence``
(the tokens, parked cells, checkpoints, a pending cell move; why cell order matters).
The last sampled token is *not* in the cache: each step verifies ``[last, *draft]`` and
then keeps the accepted path (``commit``), trimming everything else.

Prompts are read by ``engine.runtime.prefill.PromptReader`` (the F16 context, the prefill
copy, remembered prefills, the context shift), which changes sequence 0 through the same
owner.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from engine.errors import ContextFullError
from engine.runtime.architecture import RS_ROLLBACK_TOKENS
from engine.runtime.chat_template import chat_tokens
from engine.runtime.draft_tree import DraftTree
from engine.runtime.hardware import default_threads
from engine.runtime.native import (
    GreedyRun,
    NativeBatch,
    NativeContext,
    NativeModel,
    choose_flash_attn,
    trees_exact,
)
from engine.runtime.native_rpc import cpu_overrides, device_array, worker_devices
from engine.runtime.prefill import Prefill, PromptReader
from engine.runtime.sequence import CachedSequence
from engine.runtime.target_config import TargetConfig
from engine.runtime.template_choice import choose_template
from engine.runtime.verification import TreeVerifier, Verification

log = logging.getLogger(__name__)

__all__ = ["Target", "TargetConfig", "Verification", "greedy_one_at_a_time"]

# Tokens re-evaluated per batch when parked cells are freed, where any batch is exact.
COMPACT_CHUNK = 8


class OneTokenDecoder(Protocol):
    def decode_one(self, token: int) -> np.ndarray: ...

    def is_end_of_generation(self, token: int) -> bool: ...


def greedy_one_at_a_time(target: OneTokenDecoder, token: int, n_max: int
                         ) -> tuple[list[int], list[float]]:
    """``Target.decode_greedy`` through ``decode_one``, a token at a time: where the C loop
    is missing, and for targets without it (parallel lanes)."""
    chosen: list[int] = []
    seconds: list[float] = []
    for _ in range(n_max):
        t0 = time.perf_counter()
        token = int(target.decode_one(token).argmax())
        seconds.append(time.perf_counter() - t0)
        chosen.append(token)
        if target.is_end_of_generation(token):
            break
    return chosen, seconds


class Target:
    """A llama.cpp model and context: verification and decoding on sequence 0."""

    def __init__(self, model_path: str | os.PathLike[str], config: TargetConfig | None = None
                 ) -> None:
        """Raises ModelLoadError (missing, corrupt or unsupported GGUF, or no memory)."""
        self.config = c = config or TargetConfig()
        self.path = Path(model_path)
        self.n_threads = c.n_threads or default_threads()
        self.n_gpu_layers = c.n_gpu_layers
        self.model, self._worker_devices = _open_model(self.path, c)
        self.flash_attn = choose_flash_attn(c.flash_attn, self.model, c.type_k, c.type_v,
                                            on_cpu=not c.n_gpu_layers and not c.workers)
        try:
            self.arch = self.model.architecture()
            # Recurrent state is kept per sequence and per snapshot: a chain-only target
            # needs sequence 0 (and one spare), and snapshots for the longest draft.
            n_seq_max = c.n_seq_max if self.arch.trees else 2
            # The trained context bounds one sequence's positions: a cache split per
            # sequence (independent conversations) may hold that many per sequence.
            per_seq_cap = self.model.n_ctx_train or c.n_ctx
            if not c.unified_kv:
                per_seq_cap *= n_seq_max
            # Tokens of recurrent state kept to take back (llama.cpp's n_rs_seq).
            self._snapshots = RS_ROLLBACK_TOKENS if (self.arch.rs_rollback and
                                                     c.state_snapshots) else 0
            ctx = self._decoding_context(min(c.n_ctx, per_seq_cap), n_seq_max)
            self.batch = NativeBatch(c.n_batch, n_seq_max)
        except BaseException:
            self.model.close()
            raise
        self.template = choose_template(self.model, self.path.name)
        self.sequence = CachedSequence(ctx, self.batch, self.arch, c.n_batch, c.prompt_kernels)
        # Plain greedy runs in C (packaging/llama-cpp/greedy-run.patch); False: in Python.
        self.greedy_in_c = GreedyRun.available()
        self._greedy_run: GreedyRun | None = None
        # (return code, token, position) of the decode a greedy run failed on after others
        self._greedy_failed: tuple[int, int, int] | None = None
        self._verifier = TreeVerifier(self.sequence, self.batch)
        self.max_leaves = self._verifier.max_leaves
        try:
            self.prompts = PromptReader(self.model, self.path, self.arch, c, self.sequence,
                                        self.batch, self.n_threads, self.n_gpu_layers)
        except BaseException:
            for handle in (self.batch, ctx, self.model):
                handle.close()
            raise

    def _decoding_context(self, n_ctx: int, n_seq_max: int) -> NativeContext:
        """Sequence 0 and the verification's sequences."""
        return _context(self, n_ctx, n_seq_max, n_rs_seq=self._snapshots,
                        features=self.config.features, unified_kv=self.config.unified_kv,
                        n_batch=self.config.n_batch)

    def lane_context(self, n_lanes: int) -> NativeContext:
        """A second context on this model for ``n_lanes`` answers at once
        (engine.decoding.parallel): one KV stream of this context's size per sequence, and
        this context's cache types, kernels and threads, so each lane decodes as sequence
        0 does."""
        return _context(self, self.n_ctx * n_lanes, n_lanes, n_rs_seq=0, features=False,
                        unified_kv=False, n_batch=n_lanes)

    def set_threads(self, n_threads: int) -> None:
        """Decode and read prompts with ``n_threads`` threads from now on (between
        answers: the engine follows the machine's load)."""
        if n_threads == self.n_threads:
            return
        self.n_threads = n_threads
        self.ctx.set_n_threads(n_threads)
        self.prompts.set_threads(n_threads)

    @property
    def state_snapshots(self) -> int:
        """How many tokens of recurrent state can be taken back (0: none kept)."""
        return self._snapshots

    def set_state_snapshots(self, tokens: int) -> None:
        """Keep snapshots of recurrent state for the last ``tokens`` tokens (at most
        ``RS_ROLLBACK_TOKENS``), or none. Every decode writes each snapshot's short-
        convolution state, so a hybrid pays for the longest draft it may take back: none
        when it drafts nothing, 2 for memory drafts of 2. Switched between answers: a new
        decoding context takes the sequence's cells (llama.cpp's sequence state is the
        same with or without snapshots; docs/benchmarks.md: "Hybrids' snapshots"). Only
        with no drafter attached: feature settings go back to their defaults. Raises
        ModelLoadError (no memory for it)."""
        tokens = max(0, min(tokens, RS_ROLLBACK_TOKENS)) if self.arch.rs_rollback else 0
        if tokens == self._snapshots:
            return
        kept, self._snapshots = self._snapshots, tokens
        try:
            fresh = self._decoding_context(self.ctx.n_ctx, self.batch.n_seq_max)
        except BaseException:
            self._snapshots = kept
            raise
        old = self.ctx
        self.sequence.move_to(fresh)
        old.close()

    # --- lifecycle -------------------------------------------------------------------
    def close(self) -> None:
        self.prompts.close()
        for handle in (self.batch, self.ctx, self.model):
            handle.close()

    def __enter__(self) -> Target:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- facts -----------------------------------------------------------------------
    @property
    def ctx(self) -> NativeContext:
        """The decoding context (its cells are the sequence's: ``sequence.settled()``)."""
        return self.sequence.ctx

    @property
    def tokens(self) -> list[int]:
        """The tokens sequence 0 holds (read-only: ``CachedSequence`` changes them)."""
        return self.sequence.tokens

    @property
    def n_parked(self) -> int:
        return self.sequence.n_parked

    @property
    def park_seq(self) -> int:
        return self.sequence.park_seq

    @property
    def n_read_again(self) -> int:
        return self.sequence.n_read_again

    def settle(self) -> None:
        """Move the last long prompt's cells into the cache now, for a caller that reads
        the cache's state directly (a test, the bench)."""
        self.sequence.settled()

    @property
    def f16_prefill_off(self) -> str | None:
        """Why long prompts are not prefilled in the F16 context, None when they are."""
        return self.prompts.f16_off

    @f16_prefill_off.setter
    def f16_prefill_off(self, why: str | None) -> None:
        """Turn prefilling in the F16 context off, saying why, or on again (None)."""
        self.prompts.f16.set_off(why)

    @property
    def output_on_workers(self) -> bool:
        """Whether the output layer (and, tied to it, the token embeddings) is on workers:
        then only the target's own graphs can use them."""
        c = self.config
        return bool(c.workers) and c.worker_layers != 0 and not c.output_here

    @property
    def n_ctx(self) -> int:
        return self.ctx.n_ctx

    @property
    def n_past(self) -> int:
        return self.sequence.n_past

    @property
    def n_used(self) -> int:
        """KV cells taken: the committed tokens and the parked cells."""
        return self.sequence.n_used

    @property
    def n_vocab(self) -> int:
        return self.model.n_vocab

    @property
    def trees(self) -> bool:
        """Whether a draft tree can be verified (else chains only): the architecture
        allows it and the attention kernels sum a tree's rows as one token's
        (``native_policy.trees_exact``)."""
        return self.arch.trees and trees_exact(self.flash_attn, self.n_gpu_layers,
                                               self.model.n_layer)

    @property
    def max_draft(self) -> int | None:
        """The longest draft one verification may hold, None for no limit: the cache's
        (recurrent state's snapshots) and the kernels' (``TargetConfig.max_batch``)."""
        return self.max_draft_with(self._snapshots)

    def max_draft_with(self, snapshots: int) -> int | None:
        """``max_draft`` were ``snapshots`` tokens of recurrent state kept."""
        if self.arch.has_state and not snapshots:
            return 0
        limits = [m for m in (self.arch.max_draft, self.config.max_batch and
                              self.config.max_batch - 1,
                              snapshots if self.arch.rs_rollback else None)
                  if m is not None]
        return min(limits) if limits else None

    @property
    def n_embd(self) -> int:
        return self.model.n_embd

    def is_end_of_generation(self, token: int) -> bool:
        return token in self.model.eog_ids

    # --- text ------------------------------------------------------------------------
    def tokenize(self, text: str, special: bool = True) -> list[int]:
        """Tokens of ``text``; ``special`` parses control tokens such as <|im_start|>."""
        return self.model.tokenize(text, add_special=self.model.add_bos, parse_special=special)

    def chat_prompt(self, messages: list[dict[str, Any]],
                    add_generation_prompt: bool = True,
                    enable_thinking: bool | None = None,
                    tools: list[dict] | None = None) -> list[int]:
        """Tokens of a conversation in the GGUF's chat template (``chat_tokens``)."""
        return chat_tokens(self.model, self.template, messages, add_generation_prompt,
                           enable_thinking, tools)

    def token_bytes(self, token: int) -> bytes:
        return self.model.pieces()[token]

    def detokenize(self, tokens: list[int]) -> str:
        pieces = self.model.pieces()
        return b"".join(pieces[t] for t in tokens).decode("utf-8", errors="replace")

    # --- KV cache --------------------------------------------------------------------
    def reset(self, cold: bool = False) -> None:
        """Empty the KV cache. The F16 prefill context keeps its prompt unless ``cold``:
        a prompt asked again (a regenerate) then only moves its cells; a benchmark wants
        every prompt prefilled from nothing, as llama-server's without its prompt cache."""
        self.sequence.clear()
        self.prompts.forget_all(cold)

    def rollback(self, n_keep: int) -> None:
        """Forget everything after the first ``n_keep`` committed tokens."""
        self.sequence.truncate(n_keep)

    @contextmanager
    def cache_kept(self) -> Iterator[None]:
        """Sequence 0 put back as it stood after a block that empties the cache (a
        measurement between answers): its cells copied out and in again byte for byte,
        as a plan switch moves them, so the next prompt parts from the conversation as it
        would have, not read from nothing (in other chunks, with other sums)."""
        with self.sequence.kept(on_restored=self.prompts.remembered_restorer()):
            yield

    def compact(self) -> None:
        """Free the parked cells (``CachedSequence.compact``) in batches verification may
        use: at most ``max_batch`` rows where the kernels are exact only that far."""
        self.sequence.compact(self.config.max_batch or COMPACT_CHUNK)

    def set_features(self, on: bool) -> None:
        self.ctx.set_features(on)  # a flag: no need to move cells first

    def set_feature_layers(self, layers: tuple[int, ...]) -> None:
        """Features become these layers' inputs side by side (an EAGLE-3 head's), or the
        last layer's output again with none. Raises ModelLoadError for a layer this model
        lacks (nothing changed then)."""
        self.ctx.set_feature_layers(layers)
        self.prompts.set_feature_layers(layers)

    def set_next_features(self, on: bool) -> None:
        """Features become what the model's MTP block reads (its trunk's normed output,
        exported for every token), or the usual ones again when off."""
        self.ctx.set_next_features(on)
        self.prompts.set_next_features(on)

    @property
    def feature_width(self) -> int:
        """Floats per token in the features."""
        return self.ctx.feature_width

    # --- prefill ---------------------------------------------------------------------
    def prefill(self, prompt: list[int], feature_tail: int | None = None) -> Prefill:
        """Evaluate ``prompt`` in chunks, reusing the cached common prefix
        (``PromptReader.read``: long prompts in the F16 context, a regenerate's logits
        remembered, a cut-out span shifted over).

        In features mode every token evaluated is an output, which runs the LM head on
        it (a fifth of this model's compute per token); ``feature_tail`` limits the
        features to the last tokens of the prompt, so the first token comes as fast as
        in plain decoding.

        Raises ContextFullError (nothing changed) when the prompt cannot fit with room
        for one new token; NativeError on a failed decode (the cache is rolled back).
        """
        self._greedy_failed = None  # a new answer tries every decode afresh
        read = self.prompts.read(prompt, feature_tail)
        self.sequence.keep_checkpoint()
        return read

    # --- verification ----------------------------------------------------------------
    def decode_one(self, token: int) -> np.ndarray:
        """Plain decoding's step: evaluate ``token`` after sequence 0 and keep it, as
        ``verify`` with an empty draft and ``commit`` do, in fewer steps (each Python
        line here runs on caches the decode just flushed). Returns the logits after it,
        a view valid until the next decode. Raises ContextFullError (nothing changed)."""
        ctx = self._room_for(1)
        self.batch.fill_one(token, self.n_past)
        self._verifier.decode_or_trim(ctx)
        self.sequence.append_decoded([token])
        return ctx.last_logits_view(1)

    def decode_greedy(self, token: int, n_max: int) -> tuple[list[int], list[float]]:
        """Plain greedy decoding of up to ``n_max`` tokens: evaluate ``token`` after
        sequence 0 and keep it, choose the argmax of its logits, evaluate that, and so on,
        ending after an end of generation (chosen, not evaluated). Returns the tokens chosen
        (each but the last now kept, the last to be evaluated next) and each choice's
        seconds. In C where the build has Tandem's loop (no Python between two decodes),
        else ``decode_one`` at a time. Raises ContextFullError (nothing changed) when
        ``n_max`` tokens do not fit, and what the first decode raises."""
        ctx = self._room_for(n_max)
        if not self.greedy_in_c:
            return greedy_one_at_a_time(self, token, n_max)
        failed, self._greedy_failed = self._greedy_failed, None
        if failed is not None and failed[1:] == (token, self.n_past):
            # The decode a run ended on: it fails here as a token-at-a-time step would,
            # after the tokens chosen before it were streamed.
            ctx.check_decode(failed[0], 1, "batch")
        if self._greedy_run is None or self._greedy_run.stop is not self.model.eog_ids:
            self._greedy_run = GreedyRun(self.batch, self.model.eog_ids)
        try:
            chosen, seconds, rc = self._greedy_run(ctx, token, self.n_past, n_max)
        except BaseException:
            self.sequence.drop_uncommitted()
            raise
        self.sequence.append_decoded([token, *chosen[:-1]])
        if rc:
            self.sequence.drop_uncommitted()
            self._greedy_failed = (rc, chosen[-1], self.n_past)
        return chosen, seconds

    def _room_for(self, n: int) -> NativeContext:
        """The settled context, where ``n`` more cells fit; raises ContextFullError."""
        if self.n_used + n > self.n_ctx:
            raise ContextFullError(self.n_used + n, self.n_ctx, what="verification batch")
        return self.sequence.settled()

    def verify(self, root: int, draft: DraftTree) -> Verification:
        """Decode ``[root, *draft]`` in one batch (``TreeVerifier.verify``). Raises
        ContextFullError (nothing changed) when the batch does not fit."""
        return self._verifier.verify(self._room_for(1 + len(draft)), root, draft)

    def commit(self, verification: Verification, path: list[int], path_tokens: list[int]
               ) -> None:
        """Keep the accepted ``path`` (verification numbering, root first) in sequence 0."""
        self._verifier.commit(verification, path, path_tokens)


def _open_model(path: Path, c: TargetConfig) -> tuple[NativeModel, object]:
    """The target's weights, on this machine or with layers on workers; returns the
    model and the workers' devices (kept alive with it)."""
    devices = None
    offloaded = c.n_gpu_layers
    if c.workers:
        devices = device_array([d for endpoint in c.workers for d in worker_devices(endpoint)])
        offloaded = c.worker_layers
    overrides = (cpu_overrides(r"^(output|token_embd)\.weight$")
                 if c.workers and c.output_here else None)
    model = NativeModel(path, n_gpu_layers=offloaded, repack=c.repack, load_mtp=c.load_mtp,
                        devices=devices, overrides=overrides)
    return model, devices


def _context(target: Target, n_ctx: int, n_seq_max: int, n_rs_seq: int, features: bool,
             unified_kv: bool, n_batch: int) -> NativeContext:
    """A context on the target's model with its cache types, kernels and threads."""
    c = target.config
    # Op offload (batches of a CPU target on the GPU): never with workers (it would send
    # local weights over the network per batch); by default only where layers are on the
    # GPU anyway (TargetConfig.op_offload).
    op_offload = not c.workers and (c.op_offload if c.op_offload is not None
                                    else target.n_gpu_layers != 0)
    return NativeContext(target.model, n_ctx=n_ctx, n_batch=n_batch, n_seq_max=n_seq_max,
                         n_rs_seq=n_rs_seq, n_threads=target.n_threads, features=features,
                         type_k=c.type_k, type_v=c.type_v, unified_kv=unified_kv,
                         flash_attn=target.flash_attn, op_offload=op_offload)
