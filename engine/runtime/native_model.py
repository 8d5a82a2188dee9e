"""A loaded model and what reads its vocabulary: tokenizing, pieces, grammars. Thin
wrappers of llama.cpp's handles (engine.runtime.llama_bindings loads the library); each
owner has an idempotent ``close()`` and works as a context manager."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import llama_cpp
import numpy as np

from engine.errors import ClosedError, ModelLoadError, NativeError
from engine.gguf.check import why_unloadable
from engine.gguf.draft_compat import VOCAB_TYPES, VocabFacts
from engine.gguf.header import check_gguf_magic
from engine.runtime.architecture import ArchitectureFacts
from engine.runtime.llama_bindings import (
    ensure_backend,
    layer_input_api,
    log_mark,
    native_errors_since,
)


def utf8_bytes(text: str) -> bytes:
    """``text`` as UTF-8 for llama.cpp. Bytes that were not valid UTF-8 (a command line's
    surrogate escapes, lone surrogates from JSON) become U+FFFD, as an editor shows them,
    rather than a codec error."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        try:  # argv and stdin carry invalid bytes as surrogate escapes: recover them
            raw = text.encode("utf-8", "surrogateescape")
        except UnicodeEncodeError:  # other lone surrogates
            raw = text.encode("utf-8", "surrogatepass")
        return raw.decode("utf-8", "replace").encode("utf-8")



class NativeModel:
    """A loaded GGUF: weights and vocabulary."""

    def __init__(self, path: str | os.PathLike[str], n_gpu_layers: int = 0,
                 vocab_only: bool = False, repack: bool = True, load_mtp: bool = False,
                 devices: ctypes.Array[ctypes.c_void_p] | None = None,
                 overrides: ctypes.Array | None = None) -> None:
        """Raises ModelLoadError for a missing, non-GGUF, truncated or unsupported file.
        ``vocab_only`` reads the header and vocabulary, no weights (fast). ``repack``:
        llama.cpp's CPU "extra" buffers (weights repacked for SIMD; for some types a
        batch of 4+ rows then sums in another order than one row). ``load_mtp``: load
        the file's next-token (MTP) blocks too, which only an MTP context runs.
        ``devices``: the NULL-terminated devices offloaded layers go to (workers' RPC
        devices, engine.runtime.native_rpc), instead of llama.cpp's default GPUs;
        ``overrides``: tensors pinned to a buffer type (native_rpc.cpu_overrides)."""
        self.path = Path(path)
        check_gguf_magic(self.path)
        ensure_backend()
        params = llama_cpp.llama_model_default_params()
        params.n_gpu_layers = n_gpu_layers
        params.vocab_only = vocab_only
        params.use_extra_bufts = repack
        params.load_mtp = load_mtp
        if devices is not None:
            params.devices = ctypes.cast(devices, ctypes.c_void_p).value
        if overrides is not None:
            params.tensor_buft_overrides = ctypes.cast(overrides, ctypes.c_void_p).value
        self.repack = repack
        mark = log_mark()
        handle = llama_cpp.llama_model_load_from_file(str(self.path).encode(), params)
        if not handle:
            why = (why_unloadable(self.path) or native_errors_since(mark)
                   or "llama.cpp could not load it")
            raise ModelLoadError(f"cannot load {self.path}: {why}")
        self._handle = handle
        self._vocab = llama_cpp.llama_model_get_vocab(handle)
        self.n_vocab = int(llama_cpp.llama_vocab_n_tokens(self._vocab))
        self.n_embd = int(llama_cpp.llama_model_n_embd(handle))
        self.n_layer = int(llama_cpp.llama_model_n_layer(handle))  # the trunk's
        self.n_layer_nextn = int(llama_cpp.llama_model_n_layer_nextn(handle))
        # Whether those blocks' weights are loaded: an MTP context over a model loaded
        # without them passes llama.cpp's checks, then aborts on its first decode.
        self.mtp_loaded = load_mtp and self.n_layer_nextn > 0 and not vocab_only
        self.n_ctx_train = int(llama_cpp.llama_model_n_ctx_train(handle))
        self.add_bos = bool(llama_cpp.llama_vocab_get_add_bos(self._vocab))
        self.bos_id = int(llama_cpp.llama_vocab_bos(self._vocab))
        self.eog_ids = frozenset(
            t for t in range(self.n_vocab) if llama_cpp.llama_vocab_is_eog(self._vocab, t)
        )
        self._pieces: list[bytes] | None = None

    @property
    def handle(self) -> llama_cpp.llama_model_p:
        if self._handle is None:
            raise ClosedError("model")
        return self._handle

    def close(self) -> None:
        if self._handle is not None:
            llama_cpp.llama_model_free(self._handle)
            self._handle = None

    def __enter__(self) -> NativeModel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def n_head_kv(self) -> int:
        """KV heads (of layer 0); llama.cpp aborts on this for a vocab-only load."""
        return int(llama_cpp.llama_model_n_head_kv(self.handle))

    @property
    def latent_attention(self) -> bool:
        """Multi-head latent attention (DeepSeek-V2/V3, GLM-4.7-Flash): llama.cpp keeps V
        as a view of K in the cache, so both must be one type."""
        arch = self.metadata("general.architecture") or ""
        return self.metadata(f"{arch}.attention.key_length_mla") is not None

    def architecture(self) -> ArchitectureFacts:
        """The architecture's memory layout (sliding window, recurrent, hybrid)."""
        handle = self.handle
        return ArchitectureFacts(name=self.metadata("general.architecture") or "unknown",
                                 n_swa=max(0, int(llama_cpp.llama_model_n_swa(handle))),
                                 recurrent=bool(llama_cpp.llama_model_is_recurrent(handle)),
                                 hybrid=bool(llama_cpp.llama_model_is_hybrid(handle)))

    def target_layer_ids(self) -> tuple[int, ...]:
        """The target layers an EAGLE-3 head reads (empty for any other model)."""
        api = layer_input_api()
        if api is None:
            return ()
        n = int(api["n_ids"](self.handle))  # type: ignore[operator]
        ptr = api["ids"](self.handle)  # type: ignore[operator]
        return tuple(int(ptr[i]) for i in range(n)) if n and ptr else ()

    def metadata(self, key: str) -> str | None:
        buf = ctypes.create_string_buffer(1 << 16)
        # Returns the length of the value, or -1 when the key is absent.
        n = llama_cpp.llama_model_meta_val_str(self.handle, key.encode(), buf, len(buf))
        return None if n < 0 else buf.value.decode("utf-8", errors="replace")

    def chat_template(self) -> str | None:
        raw = llama_cpp.llama_model_chat_template(self.handle, None)
        return raw.decode("utf-8") if raw else None

    def tokenize(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
        self.handle  # noqa: B018 - raises ClosedError: the vocab dies with the model
        data = utf8_bytes(text)
        n_max = len(data) + 8
        buf = (llama_cpp.llama_token * n_max)()
        # Returns the count, or minus the count needed when the buffer is too small.
        n = llama_cpp.llama_tokenize(self._vocab, data, len(data), buf, n_max, add_special,
                                     parse_special)
        if n < 0:
            n_max = -n
            buf = (llama_cpp.llama_token * n_max)()
            n = llama_cpp.llama_tokenize(self._vocab, data, len(data), buf, n_max, add_special,
                                         parse_special)
        if n < 0:
            raise NativeError("llama_tokenize", n)
        return list(buf[:n])

    def pieces(self) -> list[bytes]:
        """The bytes each token id renders to (special tokens rendered), cached."""
        if self._pieces is None:
            self.handle  # noqa: B018 - raises ClosedError: the vocab dies with the model
            buf = ctypes.create_string_buffer(256)
            out = []
            for t in range(self.n_vocab):
                n = llama_cpp.llama_token_to_piece(self._vocab, t, buf, len(buf), 0, True)
                out.append(buf.raw[: max(n, 0)])
            self._pieces = out
        return self._pieces

    def vocab_facts(self) -> VocabFacts:
        """What llama.cpp's draft compatibility rules compare (a vocab-only load is enough)."""
        vocab = self._vocab
        self.handle  # noqa: B018 - raises ClosedError: the vocab dies with the model
        kind = int(llama_cpp.llama_vocab_type(vocab))
        texts = tuple((llama_cpp.llama_vocab_get_text(vocab, t) or b"")
                      for t in range(self.n_vocab))
        return VocabFacts(name=self.path.name, vocab_type=VOCAB_TYPES.get(kind, str(kind)),
                          add_bos=bool(llama_cpp.llama_vocab_get_add_bos(vocab)),
                          bos_id=int(llama_cpp.llama_vocab_bos(vocab)),
                          add_eos=bool(llama_cpp.llama_vocab_get_add_eos(vocab)),
                          eos_id=int(llama_cpp.llama_vocab_eos(vocab)), texts=texts)


class NativeGrammar:
    """One parse state of a GBNF grammar over a model's vocabulary: llama.cpp's grammar
    sampler (engine.decoding.grammar builds constrained decoding on it)."""

    CANDIDATE = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])  # llama_token_data

    def __init__(self, sampler: object) -> None:
        self._sampler = sampler

    @classmethod
    def compile(cls, model: NativeModel, gbnf: str, root: str = "root") -> NativeGrammar | None:
        """The grammar's start state; None when llama.cpp cannot parse it."""
        sampler = llama_cpp.llama_sampler_init_grammar(model._vocab, gbnf.encode("utf-8"),
                                                       root.encode("utf-8"))
        return cls(sampler) if sampler else None

    def clone(self) -> NativeGrammar:
        return NativeGrammar(llama_cpp.llama_sampler_clone(self._sampler))

    def close(self) -> None:
        if self._sampler is not None:
            llama_cpp.llama_sampler_free(self._sampler)
            self._sampler = None

    def apply(self, candidates: np.ndarray) -> None:
        """Set the logit of every candidate (a CANDIDATE array) the grammar forbids next to
        -inf, in place."""
        array = llama_cpp.llama_token_data_array(
            data=candidates.ctypes.data_as(ctypes.POINTER(llama_cpp.llama_token_data)),
            size=len(candidates), selected=-1, sorted=False)
        llama_cpp.llama_sampler_apply(self._sampler, ctypes.byref(array))

    def accept(self, token: int) -> None:
        """Advance past ``token``; llama.cpp aborts the process on one it forbids, so the
        caller checks first."""
        llama_cpp.llama_sampler_accept(self._sampler, token)


def json_schema_gbnf(schema: str) -> str:
    """GBNF for JSON values matching ``schema`` (JSON text), by llama-cpp-python's
    converter (pure Python; it lives in the package this module wraps). Raises what the
    converter raises on a schema it cannot take."""
    from llama_cpp.llama_grammar import json_schema_to_gbnf

    return json_schema_to_gbnf(schema)


def json_object_gbnf() -> str:
    """GBNF for any JSON object (llama-cpp-python's ``JSON_GBNF``)."""
    from llama_cpp.llama_grammar import JSON_GBNF

    return JSON_GBNF


def control_tokens(model: NativeModel) -> np.ndarray:
    """bool [n_vocab]: the vocabulary's control tokens (chat markup, ends of turns)."""
    flag = llama_cpp.LLAMA_TOKEN_ATTR_CONTROL
    return np.array([bool(llama_cpp.llama_vocab_get_attr(model._vocab, t) & flag)
                     for t in range(model.n_vocab)], dtype=bool)
