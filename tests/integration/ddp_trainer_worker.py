"""One rank of a 2-process ``transformers.Trainer`` run (``torchrun --standalone --nproc_per_node 2``, gloo on the
CPU) with the callback; rank 1's weight turns inf as step 3 begins. Writes ``rank{R}.json`` into ``argv[1]``."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_VERBOSITY"] = "error"

import torch  # noqa: E402
from transformers import Trainer, TrainerCallback, TrainingArguments  # noqa: E402

import nanhunt  # noqa: E402
from nanhunt.integrations.transformers import NanhuntCallback  # noqa: E402
from tests._support.hf import tiny_gpt2, token_data  # noqa: E402
from tests.integration.test_transformers_callback import STEP, _poison  # noqa: E402

RANK = int(os.environ["RANK"])


class PoisonRank1(TrainerCallback):
    def on_step_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
        if state.global_step == STEP and RANK == 1:
            _poison(model)


def main(out: str) -> None:
    args = TrainingArguments(output_dir=os.path.join(out, "out"), max_steps=6, per_device_train_batch_size=4,
                             report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True, seed=0, bf16=True)
    tr = Trainer(model=tiny_gpt2(), args=args, train_dataset=token_data(),
                 callbacks=[PoisonRank1(), NanhuntCallback(dump_dir=os.path.join(out, "nan"))])
    res: dict[str, Any] = {"world": torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1}
    try:
        tr.train()
        res["result"] = "finished"
    except nanhunt.GuardError as e:
        res.update(result="stopped", event=e.event.to_dict(), global_step=tr.state.global_step)
    with open(os.path.join(out, f"rank{RANK}.json"), "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    main(sys.argv[1])
