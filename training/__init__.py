"""Training draft heads: self-distilled data from the target, the training loop, the job
that ties them (above the engine: it uses the engine's Target and chat template)."""
