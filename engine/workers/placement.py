"""How many of a target's layers go to the workers, and the sentence that says where it
runs."""

from __future__ import annotations

from engine.errors import WorkerError
from engine.runtime.memory_fit import layers_that_fit
from engine.runtime.model_info import ModelInfo
from engine.runtime.target import TargetConfig
from engine.workers.handshake import WorkerInfo


def worker_layers(model: ModelInfo, workers: tuple[WorkerInfo, ...],
                  target_config: TargetConfig, asked: int | None) -> int:
    """Every layer on the workers (-1) where their free memory holds the weights and the
    KV cache, else the share that fits (the first layers stay here): the user named
    workers to use their memory and compute. ``asked`` (not None) overrides. Raises
    WorkerError when not one layer fits."""
    if asked is not None:
        return asked
    free = sum(w.free_bytes for w in workers)
    kv = model.kv_bytes(target_config.n_ctx, target_config.type_k, target_config.type_v)
    layers = layers_that_fit(model.size_bytes, kv, model.n_layer, free)
    if layers >= model.n_layer:
        return -1
    if layers < 1:
        raise WorkerError(", ".join(w.endpoint for w in workers),
                          f"{free / 2**30:.1f} GiB free, too little for one layer of "
                          f"{model.path.name}")
    return layers


def placement_text(model: ModelInfo, workers: tuple[WorkerInfo, ...],
                   target_config: TargetConfig) -> str:
    # llama.cpp counts the output layer as the first of the layers it offloads.
    layers, n = target_config.worker_layers, model.n_layer
    blocks = (f"all {n} layers" if layers < 0 or layers > n else
              f"the last {layers - 1} of {n} layers (the rest here)")
    output = "the output layer here" if target_config.output_here else "the output there"
    rtt = ", ".join(f"{w.endpoint} ({w.round_trip_s * 1e3:.2f} ms round trip)"
                    for w in workers)
    return f"the target runs {blocks} on worker {rtt}, {output}; drafts are made here"
