"""Fine-tune the XTTS GPT (the user's own utils/gpt_train.py, shaped like xtts-finetune-webui)."""

import json
import os

import torch
from torch import nn
from trainer import Trainer, TrainerArgs

from TTS.config.shared_configs import BaseDatasetConfig
from TTS.tts.configs.xtts_config import XttsAudioConfig
from TTS.tts.datasets import load_tts_samples
from TTS.tts.layers.xtts.trainer.gpt_trainer import GPTArgs, GPTTrainer, GPTTrainerConfig


def _swap_text_modules(model, base_state):
    """[Extended Vocab Fix] new text_embedding/text_head sized for the extended tokenizer:
    base rows copied from model.pth, new rows at the mean of the base rows, [START] last."""
    gpt = model.xtts.gpt
    new_rows = gpt.text_embedding.weight.shape[0]
    dim = gpt.text_embedding.weight.shape[1]
    old_emb = base_state["gpt.text_embedding.weight"]
    old_head_w = base_state["gpt.text_head.weight"]
    old_head_b = base_state["gpt.text_head.bias"]
    base = old_emb.shape[0] - 1  # the base tokens; the base's last row is [START]
    emb = nn.Embedding(new_rows, dim)
    head = nn.Linear(dim, new_rows)
    with torch.no_grad():
        for new, old in ((emb.weight, old_emb), (head.weight, old_head_w), (head.bias, old_head_b)):
            new[:base] = old[:base]
            new[base:new_rows - 1] = old[:base].mean(dim=0)
            new[new_rows - 1] = old[-1]
    gpt.text_embedding = emb
    gpt.text_head = head
    print(f"[Extended Vocab Fix] text embedding {old_emb.shape[0]} -> {new_rows} rows")
    return base


def train_gpt(base_dir, vocab_file, train_csv, language, output_path, *, epochs=1,
              batch_size=1, grad_accum=16, lr=5e-4, restore_path=None, continue_path=None,
              save_step=10 ** 6, lr_milestones=None, model_hook=None):
    """Build GPTArgs / GPTTrainerConfig / GPTTrainer, apply the extended vocab, fit().

    ``lr_milestones``: the MultiStepLR schedule of xtts-finetune-webui (gamma 0.5), stepped
    per optimizer step; ``continue_path``: the run folder to continue (coqui's resume)."""
    dataset = BaseDatasetConfig(formatter="coqui", dataset_name="ft_dataset",
                                path=os.path.dirname(train_csv),
                                meta_file_train=os.path.basename(train_csv), language=language)
    model_args = GPTArgs(
        max_conditioning_length=44100, min_conditioning_length=22050, max_wav_length=255995,
        max_text_length=200, mel_norm_file=os.path.join(base_dir, "mel_stats.pth"),
        dvae_checkpoint=os.path.join(base_dir, "dvae.pth"), xtts_checkpoint="",
        tokenizer_file=vocab_file, gpt_num_audio_tokens=1026, gpt_start_audio_token=1024,
        gpt_stop_audio_token=1025, gpt_use_masking_gt_prompt_approach=True,
        gpt_use_perceiver_resampler=True, gpt_layers=2, gpt_n_model_channels=64,
        gpt_n_heads=2, gpt_max_audio_tokens=605, gpt_max_text_tokens=402,
        gpt_max_prompt_tokens=70)
    audio_config = XttsAudioConfig(sample_rate=22050, dvae_sample_rate=22050,
                                   output_sample_rate=24000)
    config = GPTTrainerConfig(
        output_path=output_path, model_args=model_args, run_name="GPT_XTTS_FT",
        project_name="XTTS_trainer", dashboard_logger="tensorboard", audio=audio_config,
        batch_size=batch_size, eval_batch_size=batch_size, num_loader_workers=0,
        epochs=epochs, print_step=50, plot_step=100, log_model_step=100, save_step=save_step,
        save_n_checkpoints=1, save_checkpoints=True, print_eval=False, run_eval=False,
        optimizer="AdamW", optimizer_wd_only_on_weights=True,
        optimizer_params={"betas": [0.9, 0.96], "eps": 1e-8, "weight_decay": 1e-2},
        lr=lr, lr_scheduler="MultiStepLR" if lr_milestones else None,
        lr_scheduler_params={"milestones": list(lr_milestones), "gamma": 0.5, "last_epoch": -1}
        if lr_milestones else {}, scheduler_after_epoch=False, test_sentences=[],
        datasets=[dataset], training_seed=1)
    model = GPTTrainer(config)

    # The extended vocab: swap the text modules, then load model.pth by hand.
    checkpoint = torch.load(os.path.join(base_dir, "model.pth"), map_location="cpu")
    state = checkpoint.get("model", checkpoint)
    base = _swap_text_modules(model, state)
    text_keys = {k for k in state if k.startswith(("gpt.text_embedding.", "gpt.text_head."))}
    result = model.xtts.load_state_dict({k: v for k, v in state.items() if k not in text_keys},
                                        strict=False)
    print(f"loaded model.pth: {len(result.missing_keys)} missing keys")
    if model_hook is not None:
        model_hook(model)

    train_samples, _ = load_tts_samples(config, eval_split=False)
    trainer = Trainer(
        TrainerArgs(restore_path=restore_path, continue_path=continue_path or "",
                    skip_train_epoch=False, start_with_eval=False, grad_accum_steps=grad_accum),
        config, output_path=output_path, model=model, train_samples=train_samples,
        eval_samples=None, parse_command_line_args=False)
    trainer.fit()
    return trainer, model, base
