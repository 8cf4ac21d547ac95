from utils import training_patches  # noqa: F401  (the card's line; the launcher test removes it)

import argparse
import json
import os
import sys

import torch

from utils.gpt_train import train_gpt


def _fault_hooks(nan_at, zero_at, record):
    """CLIENT_NAN_MICRO_BATCH=k makes the text embedding's output NaN in the k-th
    micro-batch (and when that same batch is re-run), as a bad sample would;
    CLIENT_ZERO_MICRO_BATCH=k multiplies that micro-batch's loss by 0 instead (the
    reference: it contributes exactly nothing)."""
    def hook(model):
        calls = {"n": 0, "bad": None, "active": False}
        original = model.train_step

        def train_step(batch, criterion):
            calls["n"] += 1
            if calls["n"] in (nan_at, zero_at):
                calls["bad"] = batch  # held: a re-run passes this very object again
                record["faulty_samples"] = list(batch.get("filenames", []))
            calls["active"] = batch is calls["bad"]
            outputs, losses = original(batch, criterion)
            if calls["active"] and zero_at:
                losses = {k: v * 0.0 if torch.is_tensor(v) else v for k, v in losses.items()}
            return outputs, losses

        def poison(module, inputs, output):
            return output * float("nan") if calls["active"] and nan_at else output
        model.train_step = train_step
        model.xtts.gpt.text_embedding.register_forward_hook(poison)
    return hook


def _one(value):
    """coqui keeps a list when the model returns several optimizers/schedulers."""
    return value[0] if isinstance(value, (list, tuple)) else value


def _start_probe(record, out, inner):
    """At the first training step (after coqui restored a run): what the trainer resumed
    with (its step, the scheduler's count, the LR) and the text rows it starts from."""
    def hook(model):
        if inner is not None:
            inner(model)
        original = model.on_train_step_start

        def on_train_step_start(trainer):
            if "start" not in record:
                scheduler, optimizer = _one(trainer.scheduler), _one(trainer.optimizer)
                record["start"] = {
                    "total_steps_done": int(trainer.total_steps_done),
                    "scheduler_epoch": scheduler.last_epoch if scheduler is not None else None,
                    "lr": optimizer.param_groups[0]["lr"],
                    "optimizer_steps": max((int(s["step"]) for s in
                                            optimizer.state.values()), default=0),
                }
                gpt = model.xtts.gpt
                torch.save({"text_embedding": gpt.text_embedding.weight.detach().clone(),
                            "text_head": gpt.text_head.weight.detach().clone()},
                           os.path.join(out, "start_text_rows.pth"))
            return original(trainer)
        model.on_train_step_start = on_train_step_start
    return hook


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--base-dir", required=True)
    parser.add_argument("--vocab", required=True)
    parser.add_argument("--train-csv", required=True)
    parser.add_argument("--language", default="amh")
    parser.add_argument("--out", required=True)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--grad-accum", type=int, default=16)
    parser.add_argument("--restore-path", default=None)
    parser.add_argument("--continue-path", default=None)
    parser.add_argument("--save-step", type=int, default=10 ** 6)
    parser.add_argument("--lr-milestones", default="")
    args = parser.parse_args()

    record = {}
    nan_at = int(os.environ.get("CLIENT_NAN_MICRO_BATCH", 0))
    zero_at = int(os.environ.get("CLIENT_ZERO_MICRO_BATCH", 0))
    faults = _fault_hooks(nan_at, zero_at, record) if nan_at or zero_at else None
    milestones = [int(m) for m in args.lr_milestones.split(",") if m]
    os.makedirs(args.out, exist_ok=True)
    trainer, model, base = train_gpt(
        args.base_dir, args.vocab, args.train_csv, args.language, args.out, epochs=args.epochs,
        grad_accum=args.grad_accum, restore_path=args.restore_path,
        continue_path=args.continue_path, save_step=args.save_step, lr_milestones=milestones,
        model_hook=_start_probe(record, args.out, faults))

    # harness.json: what the test reads (a real project would not write it)
    torch.save(model.xtts.state_dict(), os.path.join(args.out, "final_xtts.pth"))
    patches = sys.modules.get("patches")
    record.update({
        "run_dir": trainer.output_path,
        "total_steps_done": int(trainer.total_steps_done),
        "scheduler_epoch": getattr(_one(trainer.scheduler), "last_epoch", None),
        "lr": _one(trainer.optimizer).param_groups[0]["lr"],
        "nonfinite_tensors": sum(not bool(torch.isfinite(p).all()) for p in model.parameters()),
        "tensors": sum(1 for _ in model.parameters()),
        "base_tokens": base,
        "stats": patches.stats() if patches else None,
        "applied": sorted(patches.advanced.applied()) if patches else [],
        "utils_paths": list(sys.modules["utils"].__path__),
    })
    with open(os.path.join(args.out, "harness.json"), "w") as handle:
        json.dump(record, handle, default=str)


if __name__ == "__main__":
    main()
