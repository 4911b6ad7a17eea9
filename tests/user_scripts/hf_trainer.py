"""A transformers.Trainer script as people write them: a tiny GPT-2 built from a config (nothing downloaded),
a list dataset, TrainingArguments from the command line. At optimizer step ``--bad-step`` its own callback turns
one weight of ``transformer.h.0.mlp.c_fc`` Inf (standing in for a weight an update broke), so the loss of that
step is NaN. Without nanhunt the Trainer logs a loss of 0 and finishes. nanhunt never edits this file."""

import argparse

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments


class BreakWeight(TrainerCallback):
    def __init__(self, at):
        self.at = at

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        if state.global_step == self.at:
            with torch.no_grad():
                model.get_submodule("transformer.h.0.mlp.c_fc").weight[0, 0] = float("inf")


def data(n=48):
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        ids = torch.randint(0, 64, (16,), generator=g)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--output_dir", default="out")
    parser.add_argument("--max_steps", type=int, default=6)
    parser.add_argument("--bad-step", type=int, default=-1)
    parser.add_argument("--save_steps", type=int, default=0)
    parser.add_argument("--resume_from_checkpoint", default=None)
    a = parser.parse_args()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16))
    args = TrainingArguments(
        output_dir=a.output_dir, max_steps=a.max_steps, per_device_train_batch_size=4, logging_steps=1,
        report_to=[], save_strategy="steps" if a.save_steps else "no", save_steps=a.save_steps or 500,
        use_cpu=True, disable_tqdm=True, seed=0)
    trainer = Trainer(model=model, args=args, train_dataset=data(), callbacks=[BreakWeight(a.bad_step)])
    trainer.train(resume_from_checkpoint=a.resume_from_checkpoint)
    print("losses", [round(h["loss"], 6) for h in trainer.state.log_history if "loss" in h])


if __name__ == "__main__":
    main()
