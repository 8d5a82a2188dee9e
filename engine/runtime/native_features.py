"""A context's hidden states out: the last layer's output (llama.cpp's embeddings mode),
chosen layers' inputs (an EAGLE-3 target's features), the trunk's next-token rows (what
an MTP block reads) and a draft head's own vectors. A part of
engine.runtime.native_context.LlamaContext, over its handle."""

from __future__ import annotations

from typing import TYPE_CHECKING

import llama_cpp
import numpy as np

from engine.errors import ModelLoadError, NativeError
from engine.runtime.llama_bindings import layer_input_api

if TYPE_CHECKING:
    from engine.runtime.native_model import NativeModel


class HiddenStates:
    """LlamaContext's hidden-state outputs (a mixin: the context sets these fields)."""

    handle: llama_cpp.llama_context_p
    model: NativeModel
    n_embd: int
    _features: bool  # the caller's switch: features wanted with every decode
    _llama_embeddings: bool  # llama.cpp's embeddings mode, as last set
    feature_layers: tuple[int, ...]
    next_features: bool  # features are the trunk's output for an MTP block
    _llama_nextn: bool  # llama.cpp's next-token rows flag, as last set

    def set_feature_layers(self, layers: tuple[int, ...]) -> None:
        """Which layers' inputs ``features`` gives (none: the last layer's output).
        Raises ModelLoadError for a layer the model lacks or a build that cannot."""
        layers = tuple(layers)
        if layers == self.feature_layers:
            return
        api = layer_input_api()
        bad = [i for i in layers if not 0 <= i < self.model.n_layer]
        arch = self.model.architecture()
        if layers and (api is None or bad or not arch.layer_inputs):
            # Graphs that cannot export a layer's input abort the process if asked.
            why = (f"layers {bad} are not among its {self.model.n_layer}" if bad else
                   "this llama.cpp build cannot export layer inputs" if api is None else
                   f"llama.cpp's {arch.name} graph cannot export layer inputs")
            raise ModelLoadError(f"cannot read EAGLE-3 features of {self.model.path.name}: "
                                 f"{why}")
        if api is not None:
            for layer in self.feature_layers:
                api["set"](self.handle, layer, False)
            for layer in layers:
                api["set"](self.handle, layer, True)
        self.feature_layers = layers
        self._sync_features()

    def set_next_features(self, on: bool) -> None:
        """``features`` gives what an MTP block reads, the trunk's normed output of
        every token in a batch (llama.cpp's unmasked next-token rows), with llama.cpp's
        embeddings mode off: those rows come with every decode where features are on."""
        if on and self.feature_layers:
            raise ValueError("features are layer inputs already")
        if on != self.next_features:
            self.next_features = on
            self._sync_features()

    @property
    def feature_width(self) -> int:
        """Floats per token in ``features``."""
        return self.n_embd * max(1, len(self.feature_layers))

    def set_features(self, on: bool) -> None:
        """Output hidden states too; the caller then makes every token an output.
        With ``feature_layers`` llama.cpp's embeddings mode stays off: layer inputs come
        with every decode, and some graphs (LFM2) compute no logits in that mode."""
        self._features = on
        self._sync_features()

    def _sync_features(self) -> None:
        # Next-token rows only while features are on: they unmask every row of the last
        # layer, whose sums for the last token then differ from a prompt read without
        # them (deepseek2 F32 with prompt kernels: 7e-7, the differential).
        nextn = self._features and self.next_features
        if nextn != self._llama_nextn:
            from llama_cpp import llama_cpp_ext

            llama_cpp_ext.llama_set_embeddings_nextn(self.handle, nextn, False)
            self._llama_nextn = nextn
        wanted = self._features and not self.feature_layers and not self.next_features
        if wanted != self._llama_embeddings:
            llama_cpp.llama_set_embeddings(self.handle, wanted)
            self._llama_embeddings = wanted

    @property
    def features_on(self) -> bool:
        return self._features

    def features(self, n_outputs: int) -> np.ndarray:
        """Copy of the post-norm hidden states of the last decode, [n_outputs, n_embd];
        with ``feature_layers``, those layers' inputs, [n_outputs, n_layers * n_embd]
        (every token of the batch, which callers in features mode make outputs)."""
        if not self._features:
            raise RuntimeError("features need the context made or set with features on")
        if self.next_features:
            return self.next_vectors(n_outputs)
        if not self.feature_layers:
            ptr = llama_cpp.llama_get_embeddings(self.handle)
            return np.ctypeslib.as_array(ptr, shape=(n_outputs, self.n_embd)).copy()
        api = layer_input_api()
        assert api is not None  # checked when the layers were set
        out = np.empty((n_outputs, self.feature_width), np.float32)
        for k, layer in enumerate(self.feature_layers):
            ptr = api["get"](self.handle, layer)
            rows = np.ctypeslib.as_array(ptr, shape=(n_outputs, self.n_embd))
            out[:, k * self.n_embd:(k + 1) * self.n_embd] = rows
        return out

    def next_vectors(self, n_rows: int) -> np.ndarray:
        """Copy of the last process's "nextn" rows, [n_rows, n_embd]: an eagle3 head's
        fused features after an encode, its pre-norm outputs after a decode (outputs
        only). Needs ``enable_next_vectors``."""
        from llama_cpp import llama_cpp_ext

        ptr = llama_cpp_ext.llama_get_embeddings_nextn(self.handle)
        if not ptr:
            raise NativeError("llama_get_embeddings_nextn", 0, "no rows")
        return np.ctypeslib.as_array(ptr, shape=(n_rows, self.n_embd)).copy()

    def enable_next_vectors(self) -> None:
        from llama_cpp import llama_cpp_ext

        llama_cpp_ext.llama_set_embeddings_nextn(self.handle, True, True)
