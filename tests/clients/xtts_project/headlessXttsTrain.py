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
    args = parser.parse_args()

    record = {}
    nan_at = int(os.environ.get("CLIENT_NAN_MICRO_BATCH", 0))
    zero_at = int(os.environ.get("CLIENT_ZERO_MICRO_BATCH", 0))
    trainer, model, base = train_gpt(
        args.base_dir, args.vocab, args.train_csv, args.language, args.out, epochs=args.epochs,
        grad_accum=args.grad_accum, restore_path=args.restore_path,
        model_hook=_fault_hooks(nan_at, zero_at, record) if nan_at or zero_at else None)

    # harness.json: what the test reads (a real project would not write it)
    torch.save(model.xtts.state_dict(), os.path.join(args.out, "final_xtts.pth"))
    patches = sys.modules.get("patches")
    record.update({
        "run_dir": trainer.output_path,
        "nonfinite_tensors": sum(not bool(torch.isfinite(p).all()) for p in model.parameters()),
        "tensors": sum(1 for _ in model.parameters()),
        "base_tokens": base,
        "stats": patches.stats() if patches else None,
        "applied": sorted(patches.applied()) if patches else [],
        "utils_paths": list(sys.modules["utils"].__path__),
    })
    with open(os.path.join(args.out, "harness.json"), "w") as handle:
        json.dump(record, handle, default=str)


if __name__ == "__main__":
    main()
