"""Model parallelism on a named device mesh: `dist.mesh=dp=2,pp=2` (docs/training.md, "Model
parallel").

    layout.py    `dist.mesh` -> Layout (dp, pp, tp sizes), checked against the world; no torch
    mesh.py      the run's mesh: this rank's coordinates, its groups, and the data-parallel view
                 (which slice of the global batch this rank reads, whether its loss counts)
    pipeline.py  pipeline stages over a model's declared layers, the schedules, the train step
    tensor.py    tensor-parallel plans (the GPT's, or a model's own)
"""
