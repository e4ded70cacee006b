"""The run's layout on a named device mesh (`dist.mesh=dp=2,pp=2`; docs/training.md, "Model
parallel"): one description, functions that apply it, the parts they return.

    layout.py    `dist.mesh` -> Layout (dp, pp, tp sizes), checked against the world; no torch
    dims.py      ParallelDims: the sizes and how the dp dimension holds the model, built once
    mesh.py      the run's Mesh: its ParallelDims, this rank's coordinates and groups, and the
                 data-parallel view (which slice of the global batch this rank reads, whether
                 its loss counts)
    apply.py     parallelize: the layout applied in one fixed order -> ModelParts
    parts.py     ModelParts and Pipe: what the optimizer, step, clip and checkpoints take
    split.py     pipeline split planning; stages.py the stages' activations; pipeline.py the
                 schedules and PipelineStep; tied.py the gradients a pipeline adds itself
    clip.py      gradient clipping over shards and stages
    tensor.py    tensor parallelism with a model's registered plan; styles.py what plans use
"""
