"""Weights & Biases through the wandb package, on the sender thread (wandb.init starts W&B's
service process: seconds that training does not wait for).

log.wandb.mode=offline writes the run under RUN_DIR/tracking/wandb/ for `wandb sync` to upload
later; online sends it as it trains (WANDB_API_KEY from the environment). The run's id is kept in
RUN_DIR/tracking/wandb.json with the last record logged, so a resumed run continues the same W&B
run id without logging a step twice.
"""

from __future__ import annotations

import os
import secrets

from trainer.tracking.sender import Sink, metrics_of, read_state, sent_after, write_state


class WandbSink(Sink):
    name = "W&B"

    def __init__(self, *, project, entity, mode, run_name, config, tags, state_path, folder):
        self.project, self.entity, self.mode = project, entity, mode
        self.run_name, self.config, self.tags = run_name, config, tags
        self.state_path, self.folder = state_path, folder
        self.where = f"{mode} ({folder})" if mode == "offline" else f"project {project}"
        self.state = read_state(state_path)
        self.run = None

    def connect(self) -> None:
        import wandb

        os.makedirs(self.folder, exist_ok=True)
        run_id = self.state.get("id") or secrets.token_hex(4)  # W&B's ids: 8 of [a-z0-9]
        self.run = wandb.init(
            project=self.project,
            entity=self.entity,
            name=self.run_name,
            id=run_id,
            resume="allow",
            mode=self.mode,
            dir=self.folder,
            config=self.config,
            tags=[f"{k}={v}"[:64] for k, v in self.tags.items()],
            settings=wandb.Settings(silent=True, console="off", x_disable_stats=True),
        )
        if self.state.get("id") != run_id:
            self.state = {"id": run_id, "sent": None}
            write_state(self.state_path, self.state)

    def send(self, records: list[dict]) -> None:
        for r in records:
            if values := metrics_of(r):
                self.run.log(values, step=r["step"])
        self.state["sent"] = sent_after(self.state.get("sent"), records)
        write_state(self.state_path, self.state)

    def finish(self, status: str, files: list[tuple[str, str]]) -> list[tuple[str, str]]:
        for _, path in files:
            self.run.save(path, base_path=os.path.dirname(path), policy="now")
        self.run.finish(exit_code=0 if status == "FINISHED" else 1)
        return []
