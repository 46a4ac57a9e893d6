"""Corpus BLEU from sufficient statistics that sum over hosts (the Transformer's decode metrics)."""

from __future__ import annotations

import numpy as np

from tfpod import compat

BLEU_ORDER = 4  # sacrebleu's BLEU statistics: [sys_len, ref_len, correct_1..4, total_1..4]


def bleu_statistics(hypotheses: list[str], references: list[str], lowercase: bool) -> np.ndarray:
    """sacrebleu's corpus BLEU sufficient statistics, summed over the sentences.

    Returns:
      float64 [2 + 2 * 4]: sys_len, ref_len, correct n-grams (n = 1..4), total n-grams;
      sums of these over any split of a corpus give its corpus BLEU (`bleu_from_statistics`).
    """
    from sacrebleu.metrics import BLEU

    total = np.zeros(2 + 2 * BLEU_ORDER, np.float64)
    if hypotheses:
        # sacrebleu's own statistics (BLEU.corpus_score computes these, then sums them)
        stats = compat.bleu_sentence_statistics(BLEU(lowercase=lowercase), hypotheses, references)
        total += np.sum(np.asarray(stats, np.float64), axis=0)
    return total


def bleu_from_statistics(stats: np.ndarray) -> float:
    """Corpus BLEU (0-100, sacrebleu's default exponential smoothing) from summed statistics."""
    from sacrebleu.metrics import BLEU

    stats = [int(round(x)) for x in np.asarray(stats).tolist()]
    if stats[0] == 0:
        return 0.0
    return float(BLEU.compute_bleu(correct=stats[2:2 + BLEU_ORDER], total=stats[2 + BLEU_ORDER:], sys_len=stats[0],
                                   ref_len=stats[1], smooth_method="exp").score)
