"""One rank of a 2-process Lightning run (``torchrun --standalone --nproc_per_node 2``, ``strategy="ddp"``, gloo
on the CPU) with the callback; rank 1's fc1 bias turns inf as optimizer step 3 begins. Writes ``rank{R}.json``
into ``argv[1]``."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch  # noqa: E402
import lightning.pytorch as pl  # noqa: E402

import nanhunt  # noqa: E402
from nanhunt.integrations.lightning import NanhuntCallback  # noqa: E402
from tests.integration.test_lightning_callback import STEP, TinyModule, _loader  # noqa: E402

RANK = int(os.environ["RANK"])


class PoisonRank1(pl.Callback):
    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == STEP and RANK == 1:
            with torch.no_grad():
                pl_module.fc1.bias[0] = float("inf")


def main(out: str) -> None:
    torch.manual_seed(0)
    trainer = pl.Trainer(accelerator="cpu", devices=2, num_nodes=1, strategy="ddp", precision="bf16-mixed",
                         max_steps=6, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, use_distributed_sampler=False,
                         callbacks=[PoisonRank1(), NanhuntCallback(dump_dir=os.path.join(out, "nan"))])
    res: dict[str, Any] = {}
    try:
        trainer.fit(TinyModule(), _loader())
        res["result"] = "finished"
    except nanhunt.GuardError as e:
        res.update(result="stopped", event=e.event.to_dict(), global_step=trainer.global_step,
                   world=torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1)
    with open(os.path.join(out, f"rank{RANK}.json"), "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    main(sys.argv[1])
