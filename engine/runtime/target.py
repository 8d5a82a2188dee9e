"""The target model: a GGUF run by llama.cpp, with a KV cache Tandem keeps in step.

State: sequence 0 of the KV cache holds ``tokens`` (positions 0..n_past-1). The last
sampled token is *not* in the cache: each step verifies ``[last, *draft]`` and then keeps
the accepted path (``commit``), trimming everything else.

Bit-exactness and cell order: llama.cpp's attention sums over KV cells in cell order, so
sequence 0's cells must stay in position order, as in plain decoding, or logits drift by
rounding and greedy near-ties flip. A tree's rejected nodes that sit *before* an
accepted node would leave holes that later tokens fill out of order; those cells are
parked in a sequence nobody attends to (``park_seq``) instead of being freed. Rejected
nodes after the last accepted one are freed: later tokens refill them in order.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engine.errors import ContextFullError, InvalidPromptError, ModelLoadError, NativeError
from engine.gguf.header import read_file_facts
from engine.runtime.architecture import RS_ROLLBACK_TOKENS
from engine.runtime.chat_template import check_messages
from engine.runtime.draft_tree import DraftTree
from engine.runtime.hardware import default_threads
from engine.runtime.kv_cache import TYPE_K, TYPE_V, kv_bytes_per_token
from engine.runtime.kv_transfer import (
    StateFormatError,
    f16_to_q8_0_keys,
    llama_rotates_quantized_k,
)
from engine.runtime.native import (
    NativeBatch,
    NativeContext,
    NativeModel,
    prompt_kernels,
    prompt_kernels_available,
)
from engine.runtime.native_rpc import cpu_overrides, device_array, worker_devices
from engine.runtime.prompt_weights import prompts_prefer_repacked
from engine.runtime.reasoning import for_template
from engine.runtime.sequences import common_prefix_length, find_cut
from engine.runtime.template_choice import choose_template

log = logging.getLogger(__name__)

# Shortest run of prompt tokens worth prefilling in the F16 context: llama.cpp's tiled
# attention kernel needs 64 queries in a batch, and below ~100 tokens attention is too
# small a share of the prefill to repay moving the cells (~8 us per token here).
F16_PREFILL_MIN_TOKENS = 128
# With a copy of the weights in the faster prompt layout (TargetConfig.prefill_copy) the
# F16 context is where the fast kernels are: a 53-token prompt at a 1.7B Q4_K_M shape took
# 1.06 s there against 1.91 s here. Below this few tokens the cell move is not repaid.
F16_COPY_MIN_TOKENS = 16
# At most 1/F16_MAX_REDO_SHARE of a prompt's new tokens may be tokens this cache holds
# but the F16 context would evaluate again; past that, prefilling here is sooner.
F16_MAX_REDO_SHARE = 4
# Prompts whose first-token logits are kept for a regenerate (``Target._answer_again``):
# a chat's last few turns.
REMEMBERED_PREFILLS = 4
# Fewest cached tokens after a cut (a chat's dropped turns) worth shifting rather than
# prefilling again: the shift costs a one-token decode and a copy of the sequence.
SHIFT_MIN_KEPT = 64
# The largest buffer a long prompt's cell move keeps for the next one: a 1.7B shape's
# ~800-token prompt (100 MB); longer prompts' moves allocate theirs each time.
MOVE_BUFFER_KEPT = 256 * 2**20
# Prompt tokens the move's buffer is made for when the target opens (rag prompts are
# 660-790 tokens).
MOVE_PREFAULT_TOKENS = 1024


@dataclass(frozen=True)
class TargetConfig:
    n_ctx: int = 4096
    n_threads: int | None = None  # None: one per physical core
    n_batch: int = 256  # prefill chunk; also the largest verification batch
    n_seq_max: int = 16  # sequences: a tree may have n_seq_max - 1 leaves (one parks)
    features: bool = False  # post-norm hidden states, for a draft head
    type_k: str = TYPE_K  # KV-cache types; NativeContext says why K is not f16
    type_v: str = TYPE_V
    n_gpu_layers: int = 0  # layers offloaded to a GPU (llama.cpp builds that can)
    # One KV buffer for all sequences (tree verification needs it); False gives each
    # sequence its own stream, cheaper for independent sequences (training data).
    unified_kv: bool = True
    flash_attn: bool = True
    # Long prompts are prefilled in a second, F16/F16 context and moved into this one
    # (engine.runtime.kv_transfer says why); off, or when it cannot apply, they are prefilled here.
    f16_prefill: bool = True
    # llama.cpp's repacked weights (engine.runtime.native.NativeModel); the exactness
    # probe turns them off for weight types whose batches then sum in another order.
    repack: bool = True
    # The largest verification batch whose rows are one-token decoding's (the exactness
    # probe's verdict: repacked weights run batches of up to 3 rows through the one-row
    # kernel, 4 and more through another); None: any batch.
    max_batch: int | None = None
    # Recurrent-state snapshots on hybrid models, so a rejected draft can be taken back:
    # every decode then copies the state (~10% of a token on a 2B hybrid, 2 cores), so
    # plain-only targets go without.
    state_snapshots: bool = True
    # Batches of a CPU-resident target on the GPU (llama.cpp's op offload, builds that can
    # offload): fast, but not the sums one-token decoding makes on the CPU. None: off
    # while the target is wholly on the CPU (verification then equals plain decoding),
    # on when layers are on the GPU anyway. The F16 prefill context keeps it on: plain
    # and drafted answers share that prefill.
    op_offload: bool | None = None
    # Prompts prefilled in the F16 context by a second copy of the weights where the
    # target's own layout is the slower one for prompts (engine.runtime.prompt_weights):
    # plain weights for the tiled matmul beside a repacked K-quant target (mmapped, so
    # they share the file's page cache: 1.7B Q4_K_M shape, 660 tokens in 2.6 s instead of
    # 4.2 s), or, without the prompt kernels, a repacked copy beside a target that runs
    # without repacking, where memory has room for it. Verification keeps the target's
    # own kernels; plain and drafted answers share the prefill, so they stay identical.
    prefill_copy: bool = True
    # llama.cpp's fastest batch kernels for prompts (llamafile's sgemm, the tiled K-quant
    # matmul), where the build has Tandem's switch (engine.runtime.native.prompt_kernels):
    # a gemma-3-1b-shaped Q4_K_M (1152 wide: Q5_0 and Q8_0 fallbacks) prefilled 660 tokens
    # in 4.2 s instead of 6.8 s. Verification never uses them.
    prompt_kernels: bool = True
    # The GGUF's next-token (MTP) layers, for the MTP drafter: loaded where the file has
    # them (one block of weights more; the target's own decoding never runs it).
    load_mtp: bool = True
    # Workers (HOST:PORT, engine.workers) whose devices take the target's layers, and how
    # many layers go there (-1: all, the output layer included). Open such a target in a
    # child process (engine.session_process): a lost worker aborts the process.
    workers: tuple[str, ...] = ()
    worker_layers: int = -1
    # The output layer (the LM head, and the embeddings tied to it) kept here while the
    # layers are on workers: an EAGLE-3 head's graph uses it, and llama.cpp aborts on a
    # weight in a worker's buffer there. Hidden states then cross the network, not logits.
    output_here: bool = False


@dataclass
class Verification:
    """What one verification decode produced. Valid until the next decode."""

    logits: np.ndarray  # [1 + n_draft, n_vocab]; row 0 predicts the token after the root
    features: np.ndarray | None  # [1 + n_draft, feature_width] when features are on
    leaf_seq: dict[int, int]  # draft-tree leaf (verification numbering) -> sequence id
    node_seqs: list[tuple[int, ...]]  # sequence ids of each node
    depths: list[int]  # depth of each node, the root 0


@dataclass
class Prefill:
    logits: np.ndarray  # [n_vocab] for the token after the prompt
    features: np.ndarray | None  # [n, feature_width] for the last n prompt tokens evaluated
    n_reused: int  # prompt tokens found already in the cache


class Target:
    """A llama.cpp model and context with Tandem's bookkeeping of sequence 0."""

    def _op_offload(self) -> bool:
        if self.config.workers:  # it would send local weights over the network per batch
            return False
        if self.config.op_offload is not None:
            return self.config.op_offload
        return self.n_gpu_layers != 0

    def __init__(self, model_path: str | os.PathLike[str], config: TargetConfig | None = None
                 ) -> None:
        """Raises ModelLoadError (missing, corrupt or unsupported GGUF, or no memory)."""
        self.config = config or TargetConfig()
        self.path = Path(model_path)
        self.n_threads = self.config.n_threads or default_threads()
        self.n_gpu_layers = self.config.n_gpu_layers
        self._worker_devices = None
        offloaded = self.n_gpu_layers
        if self.config.workers:
            devices = [d for endpoint in self.config.workers for d in worker_devices(endpoint)]
            self._worker_devices = device_array(devices)  # alive while the model loads
            offloaded = self.config.worker_layers
        overrides = (cpu_overrides(r"^(output|token_embd)\.weight$")
                     if self.config.workers and self.config.output_here else None)
        self.model = NativeModel(self.path, n_gpu_layers=offloaded, repack=self.config.repack,
                                 load_mtp=self.config.load_mtp, devices=self._worker_devices,
                                 overrides=overrides)
        try:
            self.arch = self.model.architecture()
            n_ctx = min(self.config.n_ctx, self.model.n_ctx_train or self.config.n_ctx)
            # Recurrent state is kept per sequence and per snapshot: a chain-only target
            # needs sequence 0 (and one spare), and snapshots for the longest draft.
            n_seq_max = self.config.n_seq_max if self.arch.trees else 2
            # Tokens of recurrent state kept to take back (llama.cpp's n_rs_seq).
            self._snapshots = RS_ROLLBACK_TOKENS if (self.arch.rs_rollback and
                                                     self.config.state_snapshots) else 0
            self._ctx = self._decoding_context(n_ctx, n_seq_max)
            self.batch = NativeBatch(self.config.n_batch, n_seq_max)
        except BaseException:
            self.model.close()
            raise
        self.template = choose_template(self.model, self.path.name)
        self.tokens: list[int] = []
        self.park_seq = n_seq_max - 1
        self.n_parked = 0  # cells parked (see module docstring)
        self._parked_from = 0  # every parked cell sits at a position >= this
        # The F16 prefill context and the tokens its sequence 0 holds; why it is not
        # used, if it is not. Made now: made on the first long prompt, it cost that
        # prompt's first token ~0.3 s.
        self._f16_ctx: NativeContext | None = None
        self._f16_tokens: list[int] = []
        # The last prompts prefilled there or with the prompt kernels, newest first: their
        # tokens, and their last token's logits and features, for a prompt asked again
        # (``_answer_again``). Only prompts whose cells are still the ones evaluated.
        self._last_prefills: list[tuple[tuple[int, ...], np.ndarray, np.ndarray | None]] = []
        # The first position whose cells are still in the F16 context, None when all are
        # here: a prompt's cells are moved after its first token is out (``ctx``).
        self._unmoved_from: int | None = None
        self._move_buffer: np.ndarray | None = None  # the cells' way out of the F16 context
        self._prefill_model: NativeModel | None = None
        self.f16_prefill_off = self._why_no_f16_prefill()
        if not self.f16_prefill_off:
            try:
                self._f16_ctx = NativeContext(
                    self._open_prefill_model(), n_ctx=self.n_ctx,
                    n_batch=self.config.n_batch, n_seq_max=2, n_threads=self.n_threads,
                    embeddings=False, type_k="f16", type_v="f16")
            except ModelLoadError as exc:
                self.f16_prefill_off = f"no memory for it: {exc}"
                log.warning("F16 prefill off, prompts are prefilled in the Q8_0 cache: %s",
                            exc)
            else:
                self._prefault_move_buffer()

    def _decoding_context(self, n_ctx: int, n_seq_max: int) -> NativeContext:
        return NativeContext(self.model, n_ctx=n_ctx, n_batch=self.config.n_batch,
                             n_seq_max=n_seq_max,
                             n_rs_seq=self._snapshots,
                             n_threads=self.n_threads,
                             embeddings=self.config.features,
                             type_k=self.config.type_k,
                             type_v=self.config.type_v,
                             unified_kv=self.config.unified_kv,
                             flash_attn=self.config.flash_attn,
                             op_offload=self._op_offload())

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
        same with or without snapshots), ~0.1 s. Only with no drafter attached: feature
        settings go back to their defaults. Raises ModelLoadError (no memory for it)."""
        tokens = max(0, min(tokens, RS_ROLLBACK_TOKENS)) if self.arch.rs_rollback else 0
        if tokens == self._snapshots:
            return
        self._settle()
        if self.n_parked:  # parked cells are a tree's: sequence 0 alone moves
            self.ctx.kv_remove(self.park_seq, -1, -1)
            self.n_parked = 0
        cells = self._ctx.state_seq_array(0) if self.tokens else None
        embeddings = self._ctx.embeddings
        kept, self._snapshots = self._snapshots, tokens
        try:
            fresh = self._decoding_context(self._ctx.n_ctx, self.batch.n_seq_max)
        except BaseException:
            self._snapshots = kept
            raise
        self._ctx.close()
        self._ctx = fresh
        fresh.set_embeddings(embeddings)
        if cells is not None:
            try:
                fresh.state_seq_set(0, cells)
            except NativeError:  # cells of a context like this one: not expected
                log.warning("the cache could not follow the new context: evaluated again")
                self._evaluate_again(self.tokens)

    @property
    def _fast_prompts(self) -> bool:
        """Whether prompts are read with the prompt kernels (asked for, and built in)."""
        return self.config.prompt_kernels and prompt_kernels_available()

    def _open_prefill_model(self) -> NativeModel:
        """The weights the F16 context prefills with: the target's own, or a copy in the
        layout its prompts prefill fastest with (``TargetConfig.prefill_copy``)."""
        c = self.config
        if not c.prefill_copy:
            return self.model
        # Without the prompt kernels only repacking speeds a prompt up.
        repack = prompts_prefer_repacked(self.path) if self._fast_prompts else True
        if repack is None or repack == c.repack:
            return self.model
        if repack and not _room_for_a_copy(self.path):  # plain weights are mmapped
            return self.model
        try:
            self._prefill_model = NativeModel(self.path, repack=repack)
        except ModelLoadError as exc:
            log.warning("prompts are prefilled with the target's own weights: %s", exc)
            return self.model
        return self._prefill_model

    # --- lifecycle -------------------------------------------------------------------
    def close(self) -> None:
        self._unmoved_from = None  # nothing left to move into a closing context
        for owner in ("_f16_ctx", "_prefill_model", "batch", "_ctx", "model"):
            handle = getattr(self, owner, None)
            if handle is not None:
                handle.close()

    def __enter__(self) -> Target:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- facts -----------------------------------------------------------------------
    @property
    def ctx(self) -> NativeContext:
        """The decoding context, holding every committed token's cells: a long prompt's,
        prefilled in the F16 context, are moved in on first use after its first token."""
        self._settle()
        return self._ctx

    def settle(self) -> None:
        """Move the last long prompt's cells in now (they move on the context's next use
        otherwise): what a chat has done by the time its next message comes."""
        self._settle()

    def _settle(self) -> None:
        """Move cells still in the F16 context here. Called before ``self.batch`` is
        filled: a failed move evaluates the prompt through that batch."""
        if self._unmoved_from is not None:
            self._move_cells()

    @property
    def output_on_workers(self) -> bool:
        """Whether the output layer (and, tied to it, the token embeddings) is on workers:
        then only the target's own graphs can use them."""
        c = self.config
        return bool(c.workers) and c.worker_layers != 0 and not c.output_here

    @property
    def n_ctx(self) -> int:
        return self._ctx.n_ctx

    @property
    def n_past(self) -> int:
        return len(self.tokens)

    @property
    def n_used(self) -> int:
        """KV cells taken: the committed tokens and the parked cells."""
        return len(self.tokens) + self.n_parked

    @property
    def n_vocab(self) -> int:
        return self.model.n_vocab

    @property
    def trees(self) -> bool:
        """Whether a draft tree can be verified (else chains only)."""
        return self.arch.trees

    @property
    def max_draft(self) -> int | None:
        """The longest draft one verification may hold, None for no limit: the cache's
        (recurrent state's snapshots) and the kernels' (``TargetConfig.max_batch``)."""
        if self.arch.has_state and not self._snapshots:
            return 0
        limits = [m for m in (self.arch.max_draft, self.config.max_batch and
                              self.config.max_batch - 1,
                              self._snapshots if self.arch.rs_rollback else None)
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

    def chat_prompt(self, messages: list[dict[str, str]],
                    add_generation_prompt: bool = True,
                    enable_thinking: bool | None = None) -> list[int]:
        """Tokens of a conversation formatted with the GGUF's chat template (with the
        assistant's opening when ``add_generation_prompt``). An earlier answer's
        reasoning section goes to the template apart (engine.runtime.reasoning);
        ``enable_thinking`` to templates that read it."""
        check_messages(messages)
        messages = for_template(messages)
        # The template writes BOS itself when the model wants one. Only its markup may
        # become control tokens: the messages' own text is tokenized as text.
        parts = self.template.render_parts(messages, add_generation_prompt, enable_thinking)
        if parts is None:
            log.warning("the chat template rewrites message texts; tokenizing it whole")
            text = self.template.render(messages, add_generation_prompt, enable_thinking)
            return self.model.tokenize(text, add_special=False, parse_special=True)
        tokens: list[int] = []
        for text, markup in parts:
            tokens += self.model.tokenize(text, add_special=False, parse_special=markup)
        return tokens

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
        self._unmoved_from = None  # cells never moved need no clearing
        self.ctx.kv_clear()
        self.tokens = []
        self._last_prefills = []
        self.n_parked = 0
        if cold and self._f16_ctx is not None:
            self._f16_ctx.kv_clear()
            self._f16_tokens = []

    def rollback(self, n_keep: int) -> None:
        """Forget everything after the first ``n_keep`` committed tokens."""
        # A prompt longer than that loses cells: its remembered logits are stale.
        self._last_prefills = [e for e in self._last_prefills if len(e[0]) <= n_keep]
        if n_keep < len(self.tokens):
            # Recurrent state further back than its snapshots is evaluated again.
            removed = self.ctx.kv_remove(0, n_keep, -1)
            del self.tokens[n_keep:]
            if not removed:
                self._evaluate_again(self.tokens)
        if self.n_parked and n_keep <= self._parked_from:
            # Every parked cell now follows every kept cell: freeing them leaves no hole.
            self.ctx.kv_remove(self.park_seq, -1, -1)
            self.n_parked = 0

    def _evaluate_again(self, kept: list[int]) -> None:
        """Rebuild sequence 0 as ``kept`` from an empty cache: for recurrent state asked
        to go back further than its snapshots reach (a new prompt sharing only part of
        the last one; never a verification within ``max_draft``)."""
        self.ctx.kv_clear()
        kept, self.tokens = list(kept), []
        self.n_parked = 0
        self._last_prefills = []  # their cells are evaluated anew, maybe in other chunks
        if kept:
            self._evaluate_cells_only(kept)

    def _evaluate_cells_only(self, tokens: list[int]) -> None:
        """Append ``tokens`` for their cells (or state) alone: no hidden states asked."""
        features = self._ctx.embeddings
        self._ctx.set_embeddings(False)
        try:
            self._evaluate_prompt(tokens)
        finally:
            self._ctx.set_embeddings(features)

    def compact(self) -> None:
        """Free the parked cells by re-evaluating the tokens committed since the first
        of them, in small batches (batch sizes verification uses, so the cache holds
        the same values). For when the context runs short."""
        if not self.n_parked:
            return
        start = self._parked_from
        redo = self.tokens[start:]
        self.rollback(start)
        self._evaluate(redo, chunk_size=8)

    def set_features(self, on: bool) -> None:
        self._ctx.set_embeddings(on)  # a flag: no need to move cells first

    def set_feature_layers(self, layers: tuple[int, ...]) -> None:
        """Features become these layers' inputs side by side (an EAGLE-3 head's), or the
        last layer's output again with none. Raises ModelLoadError for a layer this model
        lacks (nothing changed then)."""
        self._ctx.set_feature_layers(layers)
        if self._f16_ctx is not None:
            self._f16_ctx.set_feature_layers(layers)

    def set_next_features(self, on: bool) -> None:
        """Features become what the model's MTP block reads (its trunk's normed output,
        exported for every token), or the usual ones again when off."""
        self._ctx.set_next_features(on)
        if self._f16_ctx is not None:
            self._f16_ctx.set_next_features(on)

    @property
    def feature_width(self) -> int:
        """Floats per token in the features."""
        return self._ctx.feature_width

    # --- prefill ---------------------------------------------------------------------
    def prefill(self, prompt: list[int], feature_tail: int | None = None) -> Prefill:
        """Evaluate ``prompt`` in chunks, reusing the cached common prefix.

        In features mode every token evaluated is an output, which runs the LM head on
        it (a fifth of this model's compute per token); ``feature_tail`` limits the
        features to the last tokens of the prompt, so the first token comes as fast as
        in plain decoding.

        Raises ContextFullError (nothing changed) when the prompt cannot fit with room
        for one new token; NativeError on a failed decode (the cache is rolled back).
        """
        if not prompt:
            raise InvalidPromptError("the prompt is empty")
        low, high = min(prompt), max(prompt)
        if low < 0 or high >= self.n_vocab:
            bad = low if low < 0 else high
            raise InvalidPromptError(f"the prompt holds token id {bad}, outside this model's "
                                     f"vocabulary (0 to {self.n_vocab - 1})")
        if len(prompt) + 1 > self.n_ctx:
            raise ContextFullError(len(prompt) + 1, self.n_ctx)
        n_same = common_prefix_length(self.tokens, prompt)
        if n_same < len(self.tokens):
            n_same = self._keep_across_a_cut(prompt, n_same)
        again = self._answer_again(prompt, n_same, feature_tail)
        if again is not None:
            return again
        # Evaluate at least the last prompt token: its logits choose the first new token.
        n_keep = min(n_same, len(prompt) - 1)
        self.rollback(n_keep)
        todo = prompt[n_keep:]
        tail = 1  # the last token's logits choose the first new token
        if self.ctx.embeddings:
            tail = len(todo) if feature_tail is None else max(1, min(feature_tail, len(todo)))
        # A long prompt is evaluated in the F16 context, its cells moved here; the last
        # token's logits come from there too, as llama-server's do (a decode of that token
        # alone here cost a full token's time). What the drafter asks of features changes
        # neither the cells nor those logits.
        moved = self._prefill_in_f16(todo, n_features=tail if self._ctx.embeddings else 0)
        if moved is not None:
            logits, features = moved
            features = features if self._ctx.embeddings else None
            self._remember_prefill(prompt, logits, features)
            return Prefill(logits=logits, features=features, n_reused=n_keep)
        fast = self._fast_prompts
        if self.ctx.embeddings and (self.config.max_batch is not None or fast):
            # Kernels exact only in short batches (repacked K-quants), or the prompt
            # kernels: the prompt goes in plain decoding's chunks and kernels, so its
            # cells and the first token's logits are plain decoding's; the features come
            # from evaluating the tail again.
            self.ctx.set_embeddings(False)
            try:
                logits, _ = self._evaluate_prompt(todo)
            finally:
                self.ctx.set_embeddings(True)
            features = self._features_again(tail)
            if fast:
                self._remember_prefill(prompt, logits, features)
            return Prefill(logits=logits, features=features, n_reused=n_keep)
        if not self.ctx.embeddings:
            logits, _ = self._evaluate_prompt(todo)
            if fast:
                self._remember_prefill(prompt, logits, None)
            return Prefill(logits=logits, features=None, n_reused=n_keep)
        # Exact kernels for any batch: the features' tail may be a chunk of its own.
        feats: list[np.ndarray] = []
        if tail < len(todo):
            self.ctx.set_embeddings(False)
            try:
                self._evaluate(todo[:-tail], self.config.n_batch)
            finally:
                self.ctx.set_embeddings(True)
            todo = todo[-tail:]
        logits, tail_feats = self._evaluate(todo, self.config.n_batch)
        feats += tail_feats
        features = np.concatenate(feats) if feats else None
        return Prefill(logits=logits, features=features, n_reused=n_keep)

    def _evaluate_prompt(self, tokens: list[int]) -> tuple[np.ndarray, list[np.ndarray]]:
        """``_evaluate`` in prefill chunks with the prompt kernels where they are on:
        plain and drafted answers share the prefill, so its sums may be a batch's."""
        with prompt_kernels(self.config.prompt_kernels):
            return self._evaluate(tokens, self.config.n_batch)

    def _features_again(self, n: int) -> np.ndarray:
        """The hidden states of the last ``n`` cached tokens, evaluated again in a scratch
        sequence over the cells before them; sequence 0 is left as it was."""
        scratch = 1  # a tree's sequence: free between verifications
        start = self.n_past - n
        self.ctx.kv_remove(scratch, -1, -1)
        self.ctx.kv_copy(0, scratch, 0, start)
        feats = []
        try:
            for at in range(start, self.n_past, self.config.n_batch):
                end = min(at + self.config.n_batch, self.n_past)
                self.batch.fill(self.tokens[at:end], list(range(at, end)),
                                [(scratch,)] * (end - at), True)
                self.ctx.decode(self.batch)
                feats.append(np.array(self.ctx.hidden_states(end - at), copy=True))
        finally:
            self.ctx.kv_remove(scratch, -1, -1)
        return np.concatenate(feats)

    def _answer_again(self, prompt: list[int], n_same: int, feature_tail: int | None
                      ) -> Prefill | None:
        """The prefill of a prompt asked again whole (a regenerate) whose last token's
        logits came from the F16 context or the prompt kernels: those logits again, not a
        decode of that token alone, which reads the Q8_0 cache or sums otherwise and can
        pick another first token. None when it does not apply."""
        key = tuple(prompt)
        last = next((e for e in self._last_prefills if e[0] == key), None)
        if last is None or n_same < len(prompt):
            return None
        features = None
        if self.ctx.embeddings:
            want = 1 if feature_tail is None else max(1, feature_tail)
            if last[2] is None or len(last[2]) < want:
                return None
            features = last[2][-want:]
        self.rollback(len(prompt))
        return Prefill(logits=last[1].copy(), features=features, n_reused=len(prompt))

    def _remember_prefill(self, prompt: list[int], logits: np.ndarray,
                          features: np.ndarray | None) -> None:
        key = tuple(prompt)
        rest = [e for e in self._last_prefills if e[0] != key]
        self._last_prefills = [(key, logits, features)] + rest[:REMEMBERED_PREFILLS - 1]

    def _keep_across_a_cut(self, prompt: list[int], n_same: int) -> int:
        """A prompt that is the cached tokens with a span cut out after the common prefix
        (a long chat's oldest turns dropped) keeps the cells after the cut: they are
        shifted back over it, as llama.cpp's context shift does, instead of prefilled
        again. K is rotated to its new positions (a quantized K through F32, so its
        numbers change: later answers equal plain decoding's from this same cache, not a
        fresh prefill's). The sequence is then written back from the start so its cells
        stay in position order (see the module's note): new tokens would otherwise fill
        the freed cells out of order. Returns how many prompt tokens the cache now holds."""
        if self.arch.has_state or not self._ctx.can_shift:
            return n_same
        cut = find_cut(self.tokens, prompt, n_same, SHIFT_MIN_KEPT)
        if cut is None:
            return n_same
        n_cut, n_kept = cut
        end = n_same + n_cut + n_kept
        ctx = self.ctx  # moves cells still in the F16 context first
        ctx.kv_remove(self.park_seq, -1, -1)  # parked cells go with the rewrite
        self.n_parked = 0
        ctx.kv_remove(0, end, -1)
        ctx.kv_remove(0, n_same, n_same + n_cut)
        ctx.kv_shift(0, n_same + n_cut, end, -n_cut)
        kept = self.tokens[:n_same] + self.tokens[n_same + n_cut:end]
        try:
            # llama.cpp rotates K at the next decode: one token in a scratch sequence.
            self.batch.fill([kept[-1]], [len(kept)], [(1,)], [False])
            ctx.decode(self.batch)
            ctx.kv_remove(1, -1, -1)
            blob = ctx.state_seq_array(0)  # a copy: kv_clear leaves it as it was
            ctx.kv_clear()
            ctx.state_seq_set(0, blob)
        except NativeError as exc:
            log.warning("context shift failed, the prompt is prefilled again: %s", exc)
            self.reset()
            return 0
        self.tokens = kept
        self._last_prefills = []  # the kept cells moved: no prompt's logits hold
        log.info("context shift: %d tokens cut after %d, %d kept", n_cut, n_same, n_kept)
        return n_same + n_kept

    # --- F16 prefill (engine.runtime.kv_transfer) --------------------------------------------
    def _why_no_f16_prefill(self) -> str | None:
        c = self.config
        if not c.f16_prefill:
            return "turned off"
        if self.arch.why_no_cell_move:
            return self.arch.why_no_cell_move
        if c.type_k != "q8_0" or c.type_v != "f16":
            return f"the cache is {c.type_k}/{c.type_v}, not Q8_0/F16"
        if not (c.flash_attn and c.unified_kv):
            return "needs flash attention and one KV stream"
        if self.n_gpu_layers:
            return "layers run on a GPU"
        if c.workers:
            return "layers run on workers (the cell move would cross the network twice)"
        return None

    def _prefill_in_f16(self, tokens: list[int], n_features: int
                        ) -> tuple[np.ndarray, np.ndarray] | None:
        """Append ``tokens`` to sequence 0 by prefilling them in the F16 context and
        moving their cells here. Returns the last token's logits and the hidden states of
        the last ``n_features`` tokens ([0, n_embd] when none are asked), or None (nothing
        changed) when it does not apply or fails; a failure turns it off for this target,
        with a warning."""
        # The first token's logits come from the F16 context; a prompt asked again whole
        # gets them again (_answer_again), not a decode of its last token here.
        shortest = (F16_COPY_MIN_TOKENS if self._prefill_model is not None
                    else F16_PREFILL_MIN_TOKENS)
        if self.f16_prefill_off or len(tokens) < shortest:
            return None
        # The F16 context holds the prompts it prefilled, not the answers decoded here:
        # a chat's next turn would evaluate the last answer there again (a 150-token
        # message after a 400-token answer: first token 0.88 s instead of 0.35 s).
        full = self.tokens + tokens
        start = self._f16_start(full)
        if (self.n_past - start) * F16_MAX_REDO_SHARE > len(tokens):
            return None
        try:
            return self._prefill_f16_and_move(full, start, n_features)
        except (NativeError, StateFormatError, ContextFullError) as exc:
            self.ctx.kv_remove(1, -1, -1)
            self.ctx.kv_remove(0, self.n_past, -1)
            self._turn_off_f16_prefill(exc)
            return None

    def _turn_off_f16_prefill(self, exc: Exception) -> None:
        self.f16_prefill_off = f"failed: {exc}"
        log.warning("F16 prefill off, prompts are prefilled in the Q8_0 cache: %s", exc)
        if self._f16_ctx is not None:
            self._f16_ctx.close()
            self._f16_ctx = None
        if self._prefill_model is not None:
            self._prefill_model.close()
            self._prefill_model = None

    def _prefill_f16_and_move(self, full: list[int], start: int, n_features: int
                              ) -> tuple[np.ndarray, np.ndarray]:
        """Evaluate ``full`` (the committed tokens, then the new ones) from ``start`` in
        the F16 context; its new tokens become committed here, their cells moved later."""
        # The last prompt's cells leave first; a failed move closes the F16 context, so
        # it is looked up after.
        self._settle()
        f16 = self._f16_ctx
        if f16 is None:  # made with the target; dropped only when turned off
            raise NativeError("F16 prefill context", 0, "closed")
        # Features are evaluated again beside the prompt (sequence 1): asked of sequence
        # 0's chunks they would make every token an output (the LM head over the whole
        # prompt: +40% first-token time on F32) and change the last token's logits. The
        # prompt leaves at least one cell free, so at least the last token's fit.
        n_features = min(n_features, self.n_ctx - len(full))
        step = self.config.n_batch
        f16.kv_remove(0, start, -1)
        del self._f16_tokens[start:]
        with prompt_kernels(self.config.prompt_kernels):
            for pos0 in range(start, len(full), step):
                chunk = full[pos0:pos0 + step]
                outputs = [False] * len(chunk)
                outputs[-1] = pos0 + len(chunk) == len(full)
                self.batch.fill(chunk, list(range(pos0, pos0 + len(chunk))), None, outputs)
                f16.decode(self.batch)
                self._f16_tokens.extend(chunk)
            logits = f16.logits(1)[0]  # read back before the kernels change
        feats = (self._f16_features_again(f16, full, n_features) if n_features > 0
                 else np.empty((0, self.feature_width), dtype=np.float32))
        # The cells move when the context is next used: the first token does not wait
        # for the copy and the K conversion (10-35 ms on 200-800 tokens).
        self._unmoved_from = self.n_past
        self.tokens.extend(full[self.n_past:])
        return logits, feats

    def _f16_start(self, full: list[int]) -> int:
        """Where the F16 context's evaluation of ``full`` starts. Chunks start at
        multiples of n_batch, so the cells a prompt gets do not depend on which earlier
        prompt left how much in this context, nor on features asked. The last chunk is
        evaluated even when cached: its logits choose the first token."""
        step = self.config.n_batch
        n_same = common_prefix_length(self._f16_tokens, full)
        return min(n_same - n_same % step, (len(full) - 1) // step * step)

    def _move_cells(self) -> None:
        """Move the cells from ``_unmoved_from`` on out of the F16 context. If that fails,
        F16 prefill is turned off (with a warning) and those tokens are evaluated here
        instead: the first token, already chosen, came from the F16 prefill's logits."""
        start, self._unmoved_from = self._unmoved_from, None
        assert start is not None and self._f16_ctx is not None
        f16 = self._f16_ctx
        try:
            # Sequence 1 is free outside a verification: the cells travel through it.
            f16.kv_copy(0, 1, start, -1)
            try:
                blob = f16.state_seq_array(1, into=self._move_buffer)
            finally:
                f16.kv_remove(1, -1, -1)
            self._keep_move_buffer(blob)
            moved = f16_to_q8_0_keys(blob, self.model.n_head_kv,
                                           llama_rotates_quantized_k())
            self._ctx.state_seq_set(1, moved)
            self._ctx.kv_copy(1, 0, -1, -1)
            self._ctx.kv_remove(1, -1, -1)
        except (NativeError, StateFormatError) as exc:
            self._ctx.kv_remove(1, -1, -1)
            self._ctx.kv_remove(0, start, -1)
            self._turn_off_f16_prefill(exc)
            redo = self.tokens[start:]
            del self.tokens[start:]
            self._evaluate_cells_only(redo)

    def _prefault_move_buffer(self) -> None:
        """The move's buffer for a prompt of up to ``MOVE_PREFAULT_TOKENS`` tokens, its
        pages touched now, while the model opens: the first move in a process faulted it
        in before the answer's second token (110-180 ms at a 1.7B shape, where the kernel
        compacted memory for huge pages; 4-9 ms at other times). Prompts of 16+ tokens
        take the move where weights are copied for prompts, so it is used at once."""
        tokens = min(self.n_ctx, MOVE_PREFAULT_TOKENS)
        # A cell's K and V rows in F16, and its position and sequence (12 bytes).
        per_token = kv_bytes_per_token(read_file_facts(self.path), self.path.stat().st_size,
                                       "f16", "f16") + 12
        size = min(MOVE_BUFFER_KEPT, int(per_token * tokens) + 4096)
        buffer = np.empty(size, dtype=np.uint8)
        buffer[::4096] = 0
        self._move_buffer = buffer

    def _keep_move_buffer(self, blob: np.ndarray) -> None:
        """Keep the move's buffer for the next move, up to ``MOVE_BUFFER_KEPT`` bytes: a
        fresh one is faulted in page by page, and in a bench run (llama-server's runs
        between Tandem's) that took ~100 ms of a 1.7B shape's 769-token move, where the
        kernel compacted memory for huge pages each time; the same buffer again: ~9 ms."""
        base = blob.base if isinstance(blob.base, np.ndarray) else blob
        if base.nbytes <= MOVE_BUFFER_KEPT and (self._move_buffer is None or
                                                 base.nbytes > self._move_buffer.nbytes):
            self._move_buffer = base

    def _f16_features_again(self, f16: NativeContext, full: list[int], n_features: int
                            ) -> np.ndarray:
        """Hidden states of the last ``n_features`` tokens of ``full`` (all in sequence
        0 of the F16 context), evaluated again in sequence 1 on sequence 0's cells
        before them; sequence 1 is emptied after."""
        first = len(full) - n_features
        step = self.config.n_batch
        f16.kv_copy(0, 1, 0, first)  # shares the cells, copies nothing
        f16.set_embeddings(True)
        try:
            feats = []
            for pos0 in range(first, len(full), step):
                chunk = full[pos0:pos0 + step]
                self.batch.fill(chunk, list(range(pos0, pos0 + len(chunk))),
                                [(1,)] * len(chunk), True)
                f16.decode(self.batch)
                feats.append(f16.hidden_states(len(chunk)))
            return np.concatenate(feats)
        finally:
            f16.set_embeddings(False)
            f16.kv_remove(1, -1, -1)

    def _evaluate(self, tokens: list[int], chunk_size: int
                  ) -> tuple[np.ndarray, list[np.ndarray]]:
        """Append ``tokens`` to sequence 0 in chunks. Returns the last token's logits and,
        in embeddings mode, every token's features; rolls back on a failed decode."""
        self._settle()
        n_keep = self.n_past
        feats: list[np.ndarray] = []
        logits = None
        try:
            for start in range(0, len(tokens), chunk_size):
                chunk = tokens[start:start + chunk_size]
                last_chunk = start + len(chunk) == len(tokens)
                pos0 = n_keep + start
                # In features mode every token is an output (llama.cpp's embeddings
                # mode makes them so anyway).
                outputs = [self.ctx.embeddings] * len(chunk)
                outputs[-1] = last_chunk or self.ctx.embeddings
                self.batch.fill(chunk, list(range(pos0, pos0 + len(chunk))), None, outputs)
                self.ctx.decode(self.batch)
                self.tokens.extend(chunk)
                n_out = len(chunk) if self.ctx.embeddings else int(last_chunk)
                if self.ctx.embeddings:
                    feats.append(self.ctx.hidden_states(n_out))
                if last_chunk:
                    logits = self.ctx.logits(n_out)[n_out - 1]
        except BaseException:
            self.rollback(n_keep)
            raise
        assert logits is not None
        return logits, feats

    # --- independent sequences (training data) ----------------------------------------
    def decode_sequences(self, tokens: list[int], positions: list[int], seqs: list[int]
                         ) -> tuple[np.ndarray, list[int]]:
        """Decode tokens of independent sequences (one sequence id per token) outside
        the sequence-0 bookkeeping. Returns their features and the target's argmax after
        each. Needs features on; the caller owns the sequences it names."""
        if not self.ctx.embeddings:
            raise ValueError("decode_sequences needs a target opened with features=True")
        self.batch.fill(tokens, positions, [(s,) for s in seqs], True)
        self.ctx.decode(self.batch)
        return self.ctx.hidden_states(len(tokens)), self.ctx.argmax_logits(len(tokens))

    def forget_sequence(self, seq: int) -> None:
        """Drop every cached cell of ``seq`` (independent sequences only)."""
        self.ctx.kv_remove(seq, -1, -1)

    # --- verification ----------------------------------------------------------------
    def verify(self, root: int, draft: DraftTree) -> Verification:
        """Decode ``[root, *draft]`` in one batch; every node is an output.

        A chain lives in sequence 0. A tree gives each leaf its own sequence (the first
        leaf sequence 0), copies the committed prefix into each, and puts every node in
        the sequences of the leaves below it, at position n_past + depth.
        Raises ContextFullError (nothing changed) when the batch does not fit.
        """
        self._settle()
        n = 1 + len(draft)
        if self.n_used + n > self.n_ctx:
            raise ContextFullError(self.n_used + n, self.n_ctx, what="verification batch")
        base = self.n_past
        if len(draft) == 0:
            self.batch.fill_one(root, base)
            self._decode_or_trim()
            logits = self.ctx.last_logits_view(1)[None, :]
            feats = self.ctx.hidden_states(1) if self.ctx.embeddings else None
            return Verification(logits, feats, {0: 0}, [(0,)], [0])

        depths = [0] + draft.depths()
        tokens = [root] + draft.tokens
        positions = [base + d for d in depths]
        if draft.is_chain():
            node_seqs: list[tuple[int, ...]] = [(0,)] * n
            leaf_seq = {n - 1: 0}
            self.batch.fill(tokens, positions, None, True)
        else:
            leaves = [leaf + 1 for leaf in draft.leaves()]
            if len(leaves) > self.park_seq:
                raise ValueError(f"a tree of {len(leaves)} leaves exceeds the "
                                 f"{self.park_seq} sequences available")
            leaf_seq = {leaf: s for s, leaf in enumerate(leaves)}
            parents = [-1] + [p + 1 for p in draft.parents]
            below: list[set[int]] = [set() for _ in range(n)]
            for leaf, s in leaf_seq.items():
                node = leaf
                while node >= 0:
                    below[node].add(s)
                    node = parents[node]
            node_seqs = [tuple(sorted(b)) for b in below]
            for s in range(1, len(leaves)):
                self.ctx.kv_copy(0, s, -1, -1)
            self.batch.fill(tokens, positions, node_seqs, True)
        self._decode_or_trim(n_tree_seqs=len(leaf_seq))
        logits = self.ctx.logits_view(n)  # read before the next decode (acceptance)
        feats = self.ctx.hidden_states(n) if self.ctx.embeddings else None
        return Verification(logits, feats, leaf_seq, node_seqs, depths)

    def _decode_or_trim(self, n_tree_seqs: int = 1) -> None:
        try:
            self.ctx.decode(self.batch)
        except BaseException:
            self._drop_uncommitted(n_tree_seqs)
            raise

    def _drop_uncommitted(self, n_tree_seqs: int) -> None:
        self.ctx.kv_remove(0, self.n_past, -1)
        for s in range(1, n_tree_seqs):
            self.ctx.kv_remove(s, -1, -1)

    def commit(self, verification: Verification, path: list[int], path_tokens: list[int]
               ) -> None:
        """Keep the accepted ``path`` (verification numbering, root first) in sequence 0."""
        base = self.n_past
        if len(verification.depths) == 1:  # a plain step: its one cell is kept as it is
            self.tokens.extend(path_tokens)
            return
        n_keep = base + len(path)
        n_tree_seqs = len(verification.leaf_seq)
        on_path = set(path)
        for node in range(1, path[-1]):
            if node not in on_path:  # rejected, but its cell precedes an accepted one
                pos = base + verification.depths[node]
                self.ctx.kv_copy(verification.node_seqs[node][0], self.park_seq, pos, pos + 1)
                if not self.n_parked:
                    self._parked_from = base + 1
                self.n_parked += 1
        seq = verification.node_seqs[path[-1]][0]
        if seq == 0:
            if not self.ctx.kv_remove(0, n_keep, -1):
                # Past the state's snapshots (a draft longer than max_draft): rebuilt.
                log.warning("the cache could not take back %d tokens; evaluating again",
                            base + len(verification.depths) - n_keep)
                self._evaluate_again(self.tokens + path_tokens)
                return
        else:
            # The path sits in another leaf's sequence: move it into sequence 0.
            self.ctx.kv_remove(0, base + 1, -1)
            self.ctx.kv_copy(seq, 0, base + 1, n_keep)
        for s in range(1, n_tree_seqs):
            self.ctx.kv_remove(s, -1, -1)
        self.tokens.extend(path_tokens)


def _room_for_a_copy(path: Path) -> bool:
    """Whether the memory free now holds a second copy of the weights with a margin."""
    import psutil

    size = path.stat().st_size
    return psutil.virtual_memory().available > 2 * size + 1024**3
