"""A transformers.Trainer script in the way of the ``run_clm.py`` example: ``set_seed(seed)`` before the model is
made, a tiny GPT-2 with dropout built from a config (nothing downloaded), a shuffled list dataset, the Trainer
given its arguments from the command line. It prints each optimizer step's loss (``float.hex``: every bit, or
``nan``) and saves the model's weights at the end (``--weights``). ``--learning_rate 1e5`` makes the run blow up
within a few steps. nanhunt never edits this file."""

import argparse
import math

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments, set_seed


def data(n=64):
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        ids = torch.randint(0, 64, (16,), generator=g)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--output_dir", default="out")
    parser.add_argument("--weights", default="weights.pt")
    parser.add_argument("--max_steps", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--learning_rate", type=float, default=5e-4)
    a = parser.parse_args()
    set_seed(a.seed)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16, bos_token_id=0,
                        eos_token_id=0, resid_pdrop=a.dropout, embd_pdrop=a.dropout, attn_pdrop=a.dropout)
    model = GPT2LMHeadModel(config)
    args = TrainingArguments(
        output_dir=a.output_dir, max_steps=a.max_steps, per_device_train_batch_size=4, logging_steps=1,
        learning_rate=a.learning_rate, logging_nan_inf_filter=False, report_to=[], save_strategy="no",
        use_cpu=True, disable_tqdm=True, seed=a.seed)
    trainer = Trainer(model=model, args=args, train_dataset=data())
    try:
        trainer.train()
    finally:
        for h in trainer.state.log_history:
            if "loss" in h:
                loss = h["loss"]
                print(f"step {h['step'] - 1} loss {loss.hex() if math.isfinite(loss) else loss}", flush=True)
    torch.save(model.state_dict(), a.weights)


if __name__ == "__main__":
    main()
