"""The training loop of argparse_train.py and argv_train.py, in a module beside them as a project keeps its loop:
four float16 autocast steps under their Guard, the batch of step ``bad_step`` scaled past float16's range (so
autocast's cast into fc1 overflows), then the replay command of each event the Guard recorded."""

import torch


def train(model, opt, scaler, guard, loss_fn, bad_step):
    for i in range(4):
        x = torch.randn(4, 8) * (1e5 if i == bad_step else 1.0)
        y = torch.randn(4, 2)
        with guard.step((x, y)):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = guard.loss(loss_fn(model(x), y))
            scaler.scale(loss).backward()
            guard.check_grads()
            scaler.step(opt)
            scaler.update()
    for event in guard.events:
        print(event.replay_command())
