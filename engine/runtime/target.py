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

Prompts are read by ``engine.runtime.prefill.PromptReader`` (the F16 context, the prefill
copy, remembered prefills, the context shift); a long prompt's cells may wait in the F16
context until ``settle``. Every method here that decodes, copies or removes sequence 0's
cells settles first (``commit`` follows a ``verify``, which settled); ``reset`` drops
cells not moved yet.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from engine.errors import ContextFullError, NativeError
from engine.runtime.architecture import RS_ROLLBACK_TOKENS
from engine.runtime.chat_template import check_messages
from engine.runtime.draft_tree import DraftTree
from engine.runtime.hardware import default_threads
from engine.runtime.kv_cache import TYPE_K, TYPE_V
from engine.runtime.native import (
    GreedyRun,
    NativeBatch,
    NativeContext,
    NativeModel,
    prompt_kernels,
)
from engine.runtime.native_rpc import cpu_overrides, device_array, worker_devices
from engine.runtime.prefill import Prefill, PromptReader
from engine.runtime.reasoning import for_template
from engine.runtime.template_choice import choose_template

log = logging.getLogger(__name__)

# Tokens re-evaluated per batch when parked cells are freed, where any batch is exact.
COMPACT_CHUNK = 8
# Recurrent-state checkpoints kept (the last prompts'): a regenerate, a follow-up and an
# edit of the last message each go back to one of the last two.
CHECKPOINTS = 4


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
    # On: without it one token over a long cache decodes faster, but a drafted session
    # parted from plain decoding (NativeContext and docs/engine.md say more).
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
    # every decode then copies the state (docs/benchmarks.md: hybrids' snapshots), so
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
    # they share the file's page cache; docs/benchmarks.md: reading prompts), or,
    # without the prompt kernels, a repacked copy beside a target that runs
    # without repacking, where memory has room for it. Verification keeps the target's
    # own kernels; plain and drafted answers share the prefill, so they stay identical.
    prefill_copy: bool = True
    # llama.cpp's fastest batch kernels for prompts (llamafile's sgemm, the tiled K-quant
    # matmul), where the build has Tandem's switch (engine.runtime.native.prompt_kernels;
    # docs/benchmarks.md: reading prompts). Verification never uses them.
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
    """A llama.cpp model and context with Tandem's bookkeeping of sequence 0."""

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
            # Recurrent state is kept per sequence and per snapshot: a chain-only target
            # needs sequence 0 (and one spare), and snapshots for the longest draft.
            n_seq_max = self.config.n_seq_max if self.arch.trees else 2
            # The trained context bounds one sequence's positions: a cache split per
            # sequence (independent conversations) may hold that many per sequence.
            per_seq_cap = self.model.n_ctx_train or self.config.n_ctx
            if not self.config.unified_kv:
                per_seq_cap *= n_seq_max
            n_ctx = min(self.config.n_ctx, per_seq_cap)
            # Tokens of recurrent state kept to take back (llama.cpp's n_rs_seq).
            self._snapshots = RS_ROLLBACK_TOKENS if (self.arch.rs_rollback and
                                                     self.config.state_snapshots) else 0
            # The decoding context: sequence 0 and the verification's sequences. Its
            # cells are complete only after ``settle`` (see the module docstring).
            self.ctx = self._decoding_context(n_ctx, n_seq_max)
            self.batch = NativeBatch(self.config.n_batch, n_seq_max)
        except BaseException:
            self.model.close()
            raise
        self.template = choose_template(self.model, self.path.name)
        self.tokens: list[int] = []
        # Plain greedy runs in C (packaging/llama-cpp/greedy-run.patch); False: in Python.
        self.greedy_in_c = GreedyRun.available()
        self._greedy_run: GreedyRun | None = None
        # (return code, token, position) of the decode a greedy run failed on after others
        self._greedy_failed: tuple[int, int, int] | None = None
        self.park_seq = n_seq_max - 1
        self.max_leaves = self.park_seq  # a verified tree's leaves: one sequence each
        self.n_parked = 0  # cells parked (see module docstring)
        self._parked_from = 0  # every parked cell sits at a position >= this
        # Recurrent state as the last prompts left it: (their tokens, the state's blob),
        # in position order.
        self._checkpoints: list[tuple[int, np.ndarray]] = []
        # Tokens evaluated again because recurrent state could not go back to where a
        # prompt parted (a count to watch: no path should read a conversation again).
        self.n_read_again = 0
        try:
            self.prompts = PromptReader(self)
        except BaseException:
            for handle in (self.batch, self.ctx, self.model):
                handle.close()
            raise

    def _op_offload(self) -> bool:
        if self.config.workers:  # it would send local weights over the network per batch
            return False
        if self.config.op_offload is not None:
            return self.config.op_offload
        return self.n_gpu_layers != 0

    def _decoding_context(self, n_ctx: int, n_seq_max: int) -> NativeContext:
        return NativeContext(self.model, n_ctx=n_ctx, n_batch=self.config.n_batch,
                             n_seq_max=n_seq_max,
                             n_rs_seq=self._snapshots,
                             n_threads=self.n_threads,
                             features=self.config.features,
                             type_k=self.config.type_k,
                             type_v=self.config.type_v,
                             unified_kv=self.config.unified_kv,
                             flash_attn=self.config.flash_attn,
                             op_offload=self._op_offload())

    def lane_context(self, n_lanes: int) -> NativeContext:
        """A second context on this model for ``n_lanes`` answers at once
        (engine.decoding.parallel): one KV stream of this context's size per sequence, and
        this context's cache types, kernels and threads, so each lane decodes as sequence
        0 does."""
        return NativeContext(self.model, n_ctx=self.n_ctx * n_lanes, n_batch=n_lanes,
                             n_seq_max=n_lanes, n_rs_seq=0, n_threads=self.n_threads,
                             features=False, type_k=self.config.type_k,
                             type_v=self.config.type_v, unified_kv=False,
                             flash_attn=self.config.flash_attn,
                             op_offload=self._op_offload())

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
        with no drafter attached: feature
        settings go back to their defaults. Raises ModelLoadError (no memory for it)."""
        tokens = max(0, min(tokens, RS_ROLLBACK_TOKENS)) if self.arch.rs_rollback else 0
        if tokens == self._snapshots:
            return
        self.settle()
        if self.n_parked:  # parked cells are a tree's: sequence 0 alone moves
            self.ctx.kv_remove(self.park_seq, -1, -1)
            self.n_parked = 0
        cells = self.ctx.state_seq_array(0) if self.tokens else None
        embeddings = self.ctx.features_on
        kept, self._snapshots = self._snapshots, tokens
        try:
            fresh = self._decoding_context(self.ctx.n_ctx, self.batch.n_seq_max)
        except BaseException:
            self._snapshots = kept
            raise
        self.ctx.close()
        self.ctx = fresh
        fresh.set_features(embeddings)
        if cells is not None:
            try:
                fresh.state_seq_set(0, cells)
            except NativeError:  # cells of a context like this one: not expected
                log.warning("the cache could not follow the new context: evaluated again")
                self._evaluate_again(self.tokens)

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
    def settle(self) -> None:
        """Move the last long prompt's cells into the cache now (``PromptReader``); the
        methods that use the cells call it first, and a caller that reads the cache's
        state directly (a test, the bench) calls it before."""
        self.prompts.settle()

    @property
    def f16_prefill_off(self) -> str | None:
        """Why long prompts are not prefilled in the F16 context, None when they are."""
        return self.prompts.f16_off

    @f16_prefill_off.setter
    def f16_prefill_off(self, why: str | None) -> None:
        self.prompts.f16_off = why

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
        """Tokens of a conversation formatted with the GGUF's chat template (with the
        assistant's opening when ``add_generation_prompt``). An earlier answer's
        reasoning section goes to the template apart (engine.runtime.reasoning);
        ``enable_thinking`` and ``tools`` (engine.tool_syntax) to templates that read
        them."""
        check_messages(messages)
        messages = for_template(messages)
        # The template writes BOS itself when the model wants one. Only its markup may
        # become control tokens: the messages' own text is tokenized as text.
        parts = self.template.render_parts(messages, add_generation_prompt, enable_thinking,
                                           tools)
        if parts is None:
            log.warning("the chat template rewrites message texts; tokenizing it whole")
            text = self.template.render(messages, add_generation_prompt, enable_thinking, tools)
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
        self.prompts.drop_unmoved()
        self.ctx.kv_clear()
        self.tokens = []
        self._checkpoints = []
        self.prompts.forget_all(cold)
        self.n_parked = 0

    def rollback(self, n_keep: int, for_a_prompt: bool = False) -> None:
        """Forget everything after the first ``n_keep`` committed tokens.
        ``for_a_prompt``: a new prompt parts from the cache there. Recurrent state then
        goes back from a recent prompt's checkpoint (``_from_checkpoint``), never
        through its snapshots: plain decoding keeps none, and a drafted answer's
        snapshots hold other sums than the checkpoint and the tokens read again (lfm2:
        2.7e-5 apart; qwen35, one token back after a prompt: 7.2e-7)."""
        self.prompts.forget_beyond(n_keep)
        self._checkpoints = [c for c in self._checkpoints if c[0] <= n_keep]
        if n_keep < len(self.tokens):
            self.settle()
            if for_a_prompt and self.arch.has_state:
                self._from_checkpoint(n_keep)
            else:
                removed = self.ctx.kv_remove(0, n_keep, -1)
                if not removed:  # recurrent state further back than its snapshots
                    self._from_checkpoint(n_keep)
                del self.tokens[n_keep:]
        if self.n_parked and n_keep <= self._parked_from:
            # Every parked cell now follows every kept cell: freeing them leaves no hole.
            self.ctx.kv_remove(self.park_seq, -1, -1)
            self.n_parked = 0

    def keep_checkpoint(self) -> None:
        """Remember recurrent state as the prompt just read left it, as llama-server's
        context checkpoints do: a regenerate, an edit of a recent message, or a
        follow-up whose answer re-tokenizes otherwise at its end then reads from the
        checkpoint before it again, not the conversation. A copy of the state alone (not
        the attention cells), the last ``CHECKPOINTS`` prompts'; nothing on models
        without recurrent state."""
        if not self.arch.has_state or not self.tokens:
            return
        if self.has_checkpoint_at(len(self.tokens)):
            return  # (taken back to it: the same state)
        try:
            state = self.ctx.state_seq_array(0, partial=True)  # (a buffer of its own)
        except NativeError as exc:
            log.warning("no checkpoint of the recurrent state: %s", exc)
            return
        # (``rollback`` dropped every checkpoint past the cache's tokens)
        self._checkpoints = [*self._checkpoints, (len(self.tokens), state)][-CHECKPOINTS:]

    def has_checkpoint_at(self, n_tokens: int) -> bool:
        return any(at == n_tokens for at, _ in self._checkpoints)

    def _from_checkpoint(self, n_keep: int) -> None:
        """Sequence 0 as its first ``n_keep`` tokens where its recurrent state cannot go
        back that far: the last checkpoint's state at or before ``n_keep`` and the
        attention cells before it, the tokens between evaluated again; with no such
        checkpoint, the whole sequence evaluated again."""
        kept = self.tokens[:n_keep]
        self._checkpoints = [c for c in self._checkpoints if c[0] <= n_keep]
        if self._checkpoints:
            at, state = self._checkpoints[-1]
            try:
                self.ctx.state_seq_set(0, state, partial_at=at)
                # The attention cells after it; the state's last position is at - 1,
                # so its part is left as restored.
                restored = self.ctx.kv_remove(0, at, -1)
            except NativeError as exc:
                log.warning("the recurrent state's checkpoint did not restore: %s", exc)
                restored = False
            if restored:
                self.tokens = kept[:at]
                if n_keep > at:
                    self.n_read_again += n_keep - at
                    self.evaluate_cells_only(kept[at:])
                return
            self._checkpoints.clear()  # the state is in doubt: read from the start
        self._evaluate_again(kept)

    def _evaluate_again(self, kept: list[int]) -> None:
        """Rebuild sequence 0 as ``kept`` from an empty cache: for recurrent state asked
        to go back further than its snapshots reach (a new prompt sharing only part of
        the last one; never a verification within ``max_draft``)."""
        self.prompts.drop_unmoved()  # the cache is emptied: nothing left to move in
        self.ctx.kv_clear()
        self._checkpoints = []
        kept, self.tokens = list(kept), []
        self.n_read_again += len(kept)
        self.n_parked = 0
        self.prompts.forget_all()  # their cells are evaluated anew, maybe in other chunks
        if kept:
            self.evaluate_cells_only(kept)

    @contextmanager
    def cache_kept(self) -> Iterator[None]:
        """Sequence 0 put back as it stood after a block that empties the cache (a
        measurement between answers): its cells copied out and in again byte for byte,
        as a plan switch moves them, so the next prompt parts from the conversation as it
        would have, not read from nothing (in other chunks, with other sums)."""
        self.settle()
        tokens, checkpoints = list(self.tokens), list(self._checkpoints)
        remembered = list(self.prompts.remembered)
        cells = self.ctx.state_seq_array(0) if tokens else None
        try:
            yield
        finally:
            self.reset()
            if cells is not None:
                try:
                    self.ctx.state_seq_set(0, cells)
                    self.tokens, self._checkpoints = tokens, checkpoints
                    self.prompts.remembered = remembered
                except NativeError:  # a cache of the same types: not expected
                    log.warning("the cache could not be put back: evaluated again")
                    self._evaluate_again(tokens)

    def evaluate_cells_only(self, tokens: list[int]) -> None:
        """Append ``tokens`` for their cells (or state) alone: no hidden states asked."""
        features = self.ctx.features_on
        self.ctx.set_features(False)
        try:
            self.evaluate_prompt(tokens)
        finally:
            self.ctx.set_features(features)

    def compact(self) -> None:
        """Free the parked cells by re-evaluating the tokens committed since the first
        of them, in batches verification may use (at most ``max_batch`` rows where the
        kernels are exact only that far), so the cache holds the same values. For when
        the context runs short."""
        if not self.n_parked:
            return
        start = self._parked_from
        redo = self.tokens[start:]
        self.rollback(start)
        self.evaluate(redo, chunk_size=self.config.max_batch or COMPACT_CHUNK)

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
        self.keep_checkpoint()
        return read

    def evaluate_prompt(self, tokens: list[int]) -> tuple[np.ndarray, list[np.ndarray]]:
        """``evaluate`` in prefill chunks with the prompt kernels where they are on:
        plain and drafted answers share the prefill, so its sums may be a batch's."""
        with prompt_kernels(self.config.prompt_kernels):
            return self.evaluate(tokens, self.config.n_batch)

    def features_again(self, n: int) -> np.ndarray:
        """The hidden states of the last ``n`` cached tokens, evaluated again in a scratch
        sequence over the cells before them; sequence 0 is left as it was."""
        self.settle()
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
                feats.append(np.array(self.ctx.features(end - at), copy=True))
        finally:
            self.ctx.kv_remove(scratch, -1, -1)
        return np.concatenate(feats)

    def evaluate(self, tokens: list[int], chunk_size: int
                 ) -> tuple[np.ndarray, list[np.ndarray]]:
        """Append ``tokens`` to sequence 0 in chunks. Returns the last token's logits and,
        in embeddings mode, every token's features; rolls back on a failed decode."""
        self.settle()
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
                outputs = [self.ctx.features_on] * len(chunk)
                outputs[-1] = last_chunk or self.ctx.features_on
                self.batch.fill(chunk, list(range(pos0, pos0 + len(chunk))), None, outputs)
                self.ctx.decode(self.batch)
                self.tokens.extend(chunk)
                n_out = len(chunk) if self.ctx.features_on else int(last_chunk)
                if self.ctx.features_on:
                    feats.append(self.ctx.features(n_out))
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
        if not self.ctx.features_on:
            raise ValueError("decode_sequences needs a target opened with features=True")
        self.settle()
        self.batch.fill(tokens, positions, [(s,) for s in seqs], True)
        self.ctx.decode(self.batch)
        return self.ctx.features(len(tokens)), self.ctx.argmax_logits(len(tokens))

    def forget_sequence(self, seq: int) -> None:
        """Drop every cached cell of ``seq`` (independent sequences only)."""
        self.settle()
        self.ctx.kv_remove(seq, -1, -1)

    # --- verification ----------------------------------------------------------------
    def decode_one(self, token: int) -> np.ndarray:
        """Plain decoding's step: evaluate ``token`` after sequence 0 and keep it, as
        ``verify`` with an empty draft and ``commit`` do, in fewer steps (each Python
        line here runs on caches the decode just flushed). Returns the logits after it,
        a view valid until the next decode. Raises ContextFullError (nothing changed)."""
        self.settle()
        if self.n_used + 1 > self.n_ctx:
            raise ContextFullError(self.n_used + 1, self.n_ctx, what="verification batch")
        self.batch.fill_one(token, len(self.tokens))
        self._decode_or_trim()
        self.tokens.append(token)
        return self.ctx.last_logits_view(1)

    def decode_greedy(self, token: int, n_max: int) -> tuple[list[int], list[float]]:
        """Plain greedy decoding of up to ``n_max`` tokens: evaluate ``token`` after
        sequence 0 and keep it, choose the argmax of its logits, evaluate that, and so on,
        ending after an end of generation (chosen, not evaluated). Returns the tokens chosen
        (each but the last now kept, the last to be evaluated next) and each choice's
        seconds. In C where the build has Tandem's loop (no Python between two decodes),
        else ``decode_one`` at a time. Raises ContextFullError (nothing changed) when
        ``n_max`` tokens do not fit, and what the first decode raises."""
        self.settle()
        if self.n_used + n_max > self.n_ctx:
            raise ContextFullError(self.n_used + n_max, self.n_ctx, what="verification batch")
        if not self.greedy_in_c:
            return greedy_one_at_a_time(self, token, n_max)
        failed, self._greedy_failed = self._greedy_failed, None
        if failed is not None and failed[1:] == (token, len(self.tokens)):
            # The decode a run ended on: it fails here as a token-at-a-time step would,
            # after the tokens chosen before it were streamed.
            self.ctx._check("llama_decode", failed[0], 1, "batch")
        if self._greedy_run is None or self._greedy_run.stop is not self.model.eog_ids:
            self._greedy_run = GreedyRun(self.batch, self.model.eog_ids)
        try:
            chosen, seconds, rc = self._greedy_run(self.ctx, token, len(self.tokens), n_max)
        except BaseException:
            self._drop_uncommitted(1)
            raise
        self.tokens.append(token)
        self.tokens.extend(chosen[:-1])
        if rc:
            self._drop_uncommitted(1)
            self._greedy_failed = (rc, chosen[-1], len(self.tokens))
        return chosen, seconds

    def verify(self, root: int, draft: DraftTree) -> Verification:
        """Decode ``[root, *draft]`` in one batch; every node is an output.

        A chain lives in sequence 0. A tree gives each leaf its own sequence (the first
        leaf sequence 0), copies the committed prefix into each, and puts every node in
        the sequences of the leaves below it, at position n_past + depth.
        Raises ContextFullError (nothing changed) when the batch does not fit.
        """
        self.settle()
        n = 1 + len(draft)
        if self.n_used + n > self.n_ctx:
            raise ContextFullError(self.n_used + n, self.n_ctx, what="verification batch")
        base = self.n_past
        if len(draft) == 0:
            self.batch.fill_one(root, base)
            self._decode_or_trim()
            logits = self.ctx.last_logits_view(1)[None, :]
            feats = self.ctx.features(1) if self.ctx.features_on else None
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
            if len(leaves) > self.max_leaves:
                raise ValueError(f"a tree of {len(leaves)} leaves exceeds the "
                                 f"{self.max_leaves} sequences available")
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
        feats = self.ctx.features(n) if self.ctx.features_on else None
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

