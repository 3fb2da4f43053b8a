"""Logits judged as next-token distributions: the KL divergence of the target's softmax from the
reference's and how often both pick the same top-1 token, per position (llama.cpp's
``--kl-divergence`` statistics). A quantized model is judged by them besides its logits' tolerance:
against a reference running the same codes a right port is far inside both thresholds, while a
wrong scale or nibble order that leaves most logits near their values still moves the
distributions (issue 33).

Example::

    agreement = logits_agreement(target_logits, reference_logits, rtol=1e-4, atol=1e-5)
    agreement["status"], agreement["mean_kl"], agreement["top1_agreement"]  # 'pass', 3e-09, 1.0
"""

from __future__ import annotations

import torch

#: The thresholds a quantized model's logits are judged by: the mean KL divergence (nats) of the
#: target's next-token distributions from the reference's, and the least share of positions with
#: the same top-1 token (a near-tie counts as the same).
LOGITS_THRESHOLDS = {"mean_kl": 1e-3, "top1_agreement": 0.9}


def kl_rows(target: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """KL(reference || target) of each row of ``[..., vocab]`` logits, in nats (float64, ``[rows]``)."""
    vocab = reference.shape[-1] if reference.dim() else 1
    p_log = torch.log_softmax(reference.detach().cpu().double().reshape(-1, vocab), -1)
    q_log = torch.log_softmax(target.detach().cpu().double().reshape(-1, vocab), -1)
    return torch.clamp(torch.sum(p_log.exp() * (p_log - q_log), dim=-1), min=0.0)


def same_top1(target: torch.Tensor, reference: torch.Tensor, rtol: float, atol: float) -> torch.Tensor:
    """Per row, whether the target's top-1 token is the reference's, or a near-tie: the reference's
    own logit of the target's pick is within twice the tolerance of its largest (each logit may move
    by its tolerance)."""
    vocab = reference.shape[-1] if reference.dim() else 1
    ref = reference.detach().cpu().double().reshape(-1, vocab)
    picked = target.detach().cpu().double().reshape(-1, vocab).argmax(-1)
    top = ref.max(-1).values
    gap = top - ref.gather(1, picked.unsqueeze(1)).squeeze(1)
    return (picked == ref.argmax(-1)) | (gap <= 2 * (atol + rtol * top.abs()))


def logits_agreement(target: torch.Tensor, reference: torch.Tensor, rtol: float, atol: float) -> dict:
    """How ``target`` logits ``[..., vocab]`` agree with ``reference``'s as distributions, every
    position: ``{"positions", "mean_kl", "max_kl", "top1_agreement", "nonfinite", "thresholds",
    "status"}``, the status ``pass`` when both are within :data:`LOGITS_THRESHOLDS` and no position's
    logits hold NaN or infinity (``nonfinite`` counts those: they have no distribution, count as a
    different top-1, and stay out of the KL figures). ``rtol``/``atol``: the logits' tolerance,
    which decides near-ties."""
    kl = kl_rows(target, reference)
    finite = torch.isfinite(kl)
    same = same_top1(target, reference, rtol, atol) & finite
    rows, nonfinite = int(kl.numel()), int((~finite).sum())
    kept = kl[finite]
    doc = {"positions": rows, "mean_kl": float(kept.mean()) if kept.numel() else 0.0,
           "max_kl": float(kept.max()) if kept.numel() else 0.0,
           "top1_agreement": float(same.double().mean()) if rows else 1.0, "nonfinite": nonfinite,
           "thresholds": dict(LOGITS_THRESHOLDS)}
    ok = nonfinite == 0 and doc["mean_kl"] <= LOGITS_THRESHOLDS["mean_kl"] and \
        doc["top1_agreement"] >= LOGITS_THRESHOLDS["top1_agreement"]
    return {**doc, "status": "pass" if ok else "fail"}


def agreement_note(agreement: dict) -> str:
    """One line saying what :func:`logits_agreement` found, against its thresholds."""
    t = agreement["thresholds"]
    bad = agreement.get("nonfinite", 0)
    return (f"logits as distributions over {agreement['positions']} positions: mean KL {agreement['mean_kl']:.3g} "
            f"(≤ {t['mean_kl']:g}), top-1 agreement {agreement['top1_agreement']:.3f} (≥ {t['top1_agreement']:g})"
            + (f"; {bad} position(s) with NaN or infinite logits" if bad else ""))


__all__ = ["LOGITS_THRESHOLDS", "agreement_note", "kl_rows", "logits_agreement", "same_top1"]
