"""A small UnifiedVoice: the IndexTTS GPT's text embedding and head of vocab+1 rows."""

import torch
from torch import nn


class UnifiedVoice(nn.Module):
    def __init__(self, number_text_tokens, number_mel_codes=64, model_dim=32, layers=1, heads=2):
        super().__init__()
        self.number_text_tokens = number_text_tokens
        self.start_text_token = 0
        self.stop_text_token = 1
        self.number_mel_codes = number_mel_codes
        # IndexTTS: number_text_tokens * types + 1 rows (types = 1)
        self.text_embedding = nn.Embedding(number_text_tokens + 1, model_dim)
        self.mel_embedding = nn.Embedding(number_mel_codes, model_dim)
        self.pos = nn.Embedding(256, model_dim)
        block = nn.TransformerEncoderLayer(model_dim, heads, dim_feedforward=2 * model_dim,
                                           dropout=0.0, batch_first=True)
        self.gpt = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.final_norm = nn.LayerNorm(model_dim)
        self.text_head = nn.Linear(model_dim, number_text_tokens + 1)
        self.mel_head = nn.Linear(model_dim, number_mel_codes)

    def forward(self, text_ids, mel_codes):
        x = torch.cat([self.text_embedding(text_ids), self.mel_embedding(mel_codes)], dim=1)
        x = x + self.pos(torch.arange(x.shape[1], device=x.device))
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        h = self.final_norm(self.gpt(x, mask=mask, is_causal=True))
        t = text_ids.shape[1]
        text_logits = self.text_head(h[:, : t - 1])
        mel_logits = self.mel_head(h[:, t - 1: -1])
        loss_text = nn.functional.cross_entropy(text_logits.transpose(1, 2), text_ids[:, 1:])
        loss_mel = nn.functional.cross_entropy(mel_logits.transpose(1, 2), mel_codes)
        return loss_text, loss_mel
