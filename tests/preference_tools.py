"""Helpers for the preference-loss tests: tiny GPT-2, Llama and T5 models, random preference pairs
in the data front door's layout (2P rows, chosen first), and the independent computation the kit is
checked against: per-sequence log-prob sums from plain transformers forwards with the full logits
(an encoder-decoder's source run once per row, TRL's way), then the papers' formulas as TRL writes them."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    T5Config,
    T5ForConditionalGeneration,
)  # fmt: skip

from train.core import preference
from train.models import family_of

CPU = torch.device("cpu")
VOCAB = 96
TOL = 1e-5


def layout(model):
    """The family's layout, as the plan hands it to the loss (Family.layout)."""
    return family_of(getattr(model, "module", model)).layout


def preference_loss(model, *args, **kw):
    """train.core.preference.preference_loss with the model's family's data shape."""
    return preference.preference_loss(model, *args, layout=layout(model), **kw)


def build_reference(kind, model):
    return preference.build_reference(kind, model, layout=layout(model))


def reference_over(model, *args):
    return preference.reference_over(model, *args, layout=layout(model))


def gpt2(seed: int, vocab: int = VOCAB):
    torch.manual_seed(seed)
    cfg = GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=vocab, n_positions=64, bos_token_id=1,
                     eos_token_id=1, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    return GPT2LMHeadModel(cfg)


def llama(seed: int):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      bos_token_id=1, eos_token_id=1, pad_token_id=0)  # fmt: skip
    return LlamaForCausalLM(cfg)


def t5(seed: int):
    torch.manual_seed(seed)
    cfg = T5Config(
        vocab_size=VOCAB,
        d_model=32,
        d_ff=64,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        d_kv=8,
        dropout_rate=0.0,
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
    )
    return T5ForConditionalGeneration(cfg)


FAMILIES = {"gpt2": gpt2, "llama": llama, "t5": t5}


def pairs_of(n: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """n (prompt, chosen, rejected) token triples of random lengths."""
    g = torch.Generator().manual_seed(seed)

    def tokens(lo, hi):
        return torch.randint(2, VOCAB, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g)

    return [(tokens(2, 7), tokens(1, 8), tokens(1, 8)) for _ in range(n)]


def _pad(rows: list[torch.Tensor], value: int) -> torch.Tensor:
    width = max(len(r) for r in rows)
    return torch.stack([F.pad(r, (0, width - len(r)), value=value) for r in rows])


def collate(pairs, seq2seq: bool) -> dict:
    """The front door's layout: 2P rows, chosen first (causal: prompt + response, labels -100 on the
    prompt and padding); seq2seq: the P prompts as sources, the 2P responses as labels."""
    responses = [c for _, c, _ in pairs] + [r for _, _, r in pairs]
    if seq2seq:
        sources = [p for p, _, _ in pairs]
        ids = _pad(sources, 0)
        return {"input_ids": ids, "attention_mask": _pad([torch.ones_like(s) for s in sources], 0),
                "labels": _pad(responses, -100)}  # fmt: skip
    prompts = [p for p, _, _ in pairs] * 2
    ids = [torch.cat([p, r]) for p, r in zip(prompts, responses, strict=True)]
    labels = [torch.cat([torch.full_like(p, -100), r]) for p, r in zip(prompts, responses, strict=True)]
    return {"input_ids": _pad(ids, 0), "attention_mask": _pad([torch.ones_like(i) for i in ids], 0),
            "labels": _pad(labels, -100)}  # fmt: skip


def plain_sums(model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed response log-probs, response tokens) per row from the full logits."""
    labels = batch["labels"]
    if model.config.is_encoder_decoder:  # TRL's way: the source once per row
        logits = model(
            input_ids=batch["input_ids"].repeat(2, 1),
            attention_mask=batch["attention_mask"].repeat(2, 1),
            labels=labels,
        ).logits
    else:
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
        labels = labels[:, 1:]
    valid = labels != -100
    logp = logits.float().log_softmax(-1).gather(-1, labels.clamp(min=0)[..., None])[..., 0]
    return (logp * valid).sum(-1), valid.sum(-1).float()


def plain_loss(name: str, pol, ref, counts, beta=0.5, label_smoothing=0.0, simpo_gamma=0.5, sft_weight=0.0):
    """The papers' formulas (TRL's forms) on plain tensors -> (loss, metrics as TRL 1.16 logs them:
    DPOTrainer's sigmoid, hinge and ipo sum logps over the reply, CPO's simpo and ORPO take the mean)."""
    p, ls, gamma = len(pol) // 2, label_smoothing, simpo_gamma
    normalise = name in ("ipo", "simpo", "orpo")
    lp = pol / counts if normalise else pol
    lr = (ref / counts if normalise else ref) if ref is not None else torch.zeros_like(pol)
    pc, pr, rc, rr = lp[:p], lp[p:], lr[:p], lr[p:]
    x = (pc - rc) - (pr - rr)
    if name == "sigmoid":
        losses = -(1 - ls) * F.logsigmoid(beta * x) - ls * F.logsigmoid(-beta * x)
    elif name == "ipo":
        losses = (x - 1 / (2 * beta)) ** 2
    elif name == "hinge":
        losses = torch.clamp(1 - beta * x, min=0)
    elif name == "simpo":
        z = beta * (pc - pr) - gamma
        losses = -(1 - ls) * F.logsigmoid(z) - ls * F.logsigmoid(-z)
    else:  # orpo: odds p / (1 - p) of the per-token mean likelihood
        odds_c, odds_r = pc - torch.log(1 - torch.exp(pc)), pr - torch.log(1 - torch.exp(pr))
        losses = -beta * F.logsigmoid(odds_c - odds_r)
    nll = -pol[:p].sum() / counts[:p].sum()
    loss = losses.mean() + (sft_weight + (name == "orpo")) * nll
    if name == "ipo":  # DPOTrainer's IPO logs the summed log-probs (its normalisation is the loss's alone)
        ref0 = ref if ref is not None else torch.zeros_like(pol)
        pc, pr, rc, rr = pol[:p], pol[p:], ref0[:p], ref0[p:]
    wc, wr = beta * (pc - rc), beta * (pr - rr)
    metrics = {
        "rewards/chosen": wc.mean(),
        "rewards/rejected": wr.mean(),
        "rewards/margins": (wc - wr).mean(),
        "rewards/accuracies": (wc > wr).float().mean(),
        "logps/chosen": pc.mean(),
        "logps/rejected": pr.mean(),
    }
    return loss, metrics
