"""IndexTTS2-style GPT fine-tuning on Amharic (a client-shaped plain PyTorch loop)."""

import argparse
import json
import math
import os
import random
import sys
from pathlib import Path

import numpy as np
import sentencepiece as spm
import torch
from torch.cuda.amp import GradScaler, autocast  # the names the real trainer uses
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from indextts.unified_voice import UnifiedVoice  # noqa: E402


class TextMelDataset(Dataset):
    """Lines ``utt_id|text``; the mel codes are a deterministic stand-in per utterance."""

    def __init__(self, path, tokenizer, text_len=24, mel_len=16):
        self.rows = [line.rstrip("\n").split("|", 1) for line in open(path, encoding="utf-8")]
        self.tokenizer, self.text_len, self.mel_len = tokenizer, text_len, mel_len

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, index):
        utt, text = self.rows[index]
        ids = [0] + self.tokenizer.encode(text)[: self.text_len - 2] + [1]
        ids += [1] * (self.text_len - len(ids))
        g = torch.Generator().manual_seed(index)
        return {"utt_id": utt, "text_ids": torch.tensor(ids),
                "mel_codes": torch.randint(0, 64, (self.mel_len,), generator=g)}


def collate(items):
    return {"utt_ids": [i["utt_id"] for i in items],
            "text_ids": torch.stack([i["text_ids"] for i in items]),
            "mel_codes": torch.stack([i["mel_codes"] for i in items])}


def cosine_with_warmup(warmup, total):
    def factor(step):
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return factor


def save_checkpoint(out, model, optimizer, scheduler, scaler, global_step):
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
             "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(),
             "global_step": global_step,
             "rng_state": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
                           "python": random.getstate()}}
    torch.save(state, out / f"model_step{global_step}.pth")
    tmp = out / "latest.pth.tmp"
    torch.save(state, tmp)
    os.replace(tmp, out / "latest.pth")  # atomic


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--bpe", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--total-steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--save-every", type=int, default=4)
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--resume", default=None, help="a checkpoint to continue from")
    p.add_argument("--loader", choices=["own", "patches"], default="own")
    args = p.parse_args()

    torch.manual_seed(1234)
    np.random.seed(1234)
    random.seed(1234)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = spm.SentencePieceProcessor(model_file=args.bpe)
    model = UnifiedVoice(tokenizer.get_piece_size())
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    factor = cosine_with_warmup(args.warmup, args.total_steps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    use_amp = torch.cuda.is_available()
    scaler = GradScaler(enabled=use_amp)
    record = {"lr_checks": []}

    global_step = 0
    if args.resume:
        if args.loader == "patches":
            import patches  # the library's loader: a grown vocabulary keeps every trained row

            report = patches.load_checkpoint(args.resume, model, optimizer, scheduler, scaler,
                                             policy="remap")
            global_step = report.step
        else:
            ckpt = torch.load(args.resume, map_location="cpu", weights_only=False)
            model.load_state_dict(ckpt["model"])
            optimizer.load_state_dict(ckpt["optimizer"])
            scheduler.load_state_dict(ckpt["scheduler"])
            scaler.load_state_dict(ckpt["scaler"])
            np.random.set_state(ckpt["rng_state"]["numpy"])
            global_step = ckpt["global_step"]
        # the trainer's own check: the LR must be the schedule's at the restored step
        expected = args.lr * factor(global_step)
        actual = optimizer.param_groups[0]["lr"]
        mismatch = abs(actual - expected) / expected
        record["lr_checks"].append({"step": global_step, "expected": expected,
                                    "actual": actual})
        if mismatch > 0.01:
            print(f"WARNING: LR mismatch ({100 * mismatch:.1f}%) at step {global_step}")
        else:
            print(f"LR check OK at step {global_step}: {actual:.3e}")

    # CLIENT_NAN_MICRO_BATCH=k: the k-th micro-batch of this process comes out NaN from
    # the text embedding, as a bad sample in fp16 would.
    nan_at = int(os.environ.get("CLIENT_NAN_MICRO_BATCH", 0))
    micro = {"n": 0}

    def poison(module, inputs, output):
        return output * float("nan") if micro["n"] == nan_at else output
    model.text_embedding.register_forward_hook(poison)
    start_embedding = model.text_embedding.weight.detach().clone()
    torch.save(start_embedding, out / "start_embedding.pt")  # harness

    dataset = TextMelDataset(args.data, tokenizer)
    loader = DataLoader(dataset, batch_size=args.batch, shuffle=True, collate_fn=collate,
                        num_workers=args.workers,
                        multiprocessing_context="spawn" if args.workers else None,
                        generator=torch.Generator().manual_seed(global_step))
    model.train()
    done = False
    while not done:
        for batch in loader:
            micro["n"] += 1
            if micro["n"] == nan_at:
                record["faulty_samples"] = batch["utt_ids"]
            with autocast(enabled=use_amp):
                loss_text, loss_mel = model(batch["text_ids"], batch["mel_codes"])
                loss = (0.1 * loss_text + loss_mel) / args.accum
            scaler.scale(loss).backward()
            if micro["n"] % args.accum:
                continue
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            global_step += 1
            if global_step % args.save_every == 0:
                save_checkpoint(out, model, optimizer, scheduler, scaler, global_step)
            if global_step >= args.steps:
                done = True
                break

    # harness.json: what the test reads (a real trainer would not write it)
    patches = sys.modules.get("patches")
    record.update({
        "global_step": global_step, "scheduler_epoch": scheduler.last_epoch,
        "lr": optimizer.param_groups[0]["lr"], "expected_lr": args.lr * factor(global_step),
        "nonfinite_tensors": sum(not bool(torch.isfinite(t).all()) for t in model.parameters()),
        "tensors": sum(1 for _ in model.parameters()),
        "rows_moved": (model.text_embedding.weight.detach() - start_embedding).abs()
        .amax(dim=1).tolist() if start_embedding.shape == model.text_embedding.weight.shape
        else None,
        "stats": patches.stats() if patches else None,
        "applied": sorted(patches.advanced.applied()) if patches else [],
    })
    (out / "harness.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
