"""Synthetic data shared by the reference models: deterministic in (seed, rank, step), no downloads."""
from __future__ import annotations

import functools

import numpy as np


def batch_rng(seed: int, rank: int, step: int) -> np.random.RandomState:
    """The generator for one rank's batch at one step: every rank and step gets its own stream."""
    return np.random.RandomState((seed + 1000003 * rank + step) % 2**32)


@functools.lru_cache(maxsize=64)     # a model's tables at a time (criteo: 26)
def zipf_cdf(vocab: int, exponent: float) -> np.ndarray:
    """CDF of a Zipf law over token ids 0..vocab-1 (id 0 the most frequent), as the
    log-uniform candidate sampler of sampled softmax assumes."""
    weights = 1.0 / np.arange(1, vocab + 1, dtype=np.float64) ** exponent
    cdf = np.cumsum(weights)
    return cdf / cdf[-1]


def zipf_token_rows(rng: np.random.RandomState, rows: int, length: int, vocab: int,
                    exponent: float = 1.1, follow_prob: float = 0.5) -> np.ndarray:
    """[rows, length] int64 token streams: Zipf unigrams, and with `follow_prob` a token is its
    predecessor's fixed successor, so an LSTM has sequential structure to learn beyond unigrams."""
    cdf = zipf_cdf(vocab, exponent)
    tokens = np.minimum(np.searchsorted(cdf, rng.random_sample((rows, length))), vocab - 1)
    follows = rng.random_sample((rows, length)) < follow_prob
    for t in range(1, length):
        successor = (tokens[:, t - 1] * 7 + 1) % min(vocab, 1000)  # stays among frequent ids
        tokens[:, t] = np.where(follows[:, t], successor, tokens[:, t])
    return tokens.astype(np.int64)


@functools.lru_cache(maxsize=8)
def class_templates(num_classes: int, height: int, width: int, channels: int, seed: int) -> np.ndarray:
    """One smooth random pattern per class: low-frequency so small convolutions can pick it up."""
    rng = np.random.RandomState(seed + 7919)
    coarse = rng.normal(size=(num_classes, height // 4 + 1, width // 4 + 1, channels))
    fine = np.repeat(np.repeat(coarse, 4, axis=1), 4, axis=2)[:, :height, :width, :]
    return fine.astype(np.float32)


def pattern_images(rng: np.random.RandomState, batch: int, num_classes: int, height: int, width: int,
                   channels: int, seed: int, noise: float = 1.0, label_noise: float = 0.0):
    """Images = class template + Gaussian noise; labels uniform over classes. With label_noise p a
    label is replaced by a uniformly drawn one with probability p, so no model can beat the loss
    floor label_entropy(p, num_classes): losses then converge to a known value instead of 0."""
    labels = rng.randint(0, num_classes, size=batch).astype(np.int64)
    templates = class_templates(num_classes, height, width, channels, seed)
    images = templates[labels] + noise * rng.normal(size=(batch, height, width, channels))
    if label_noise:  # drawn after the images, so label_noise 0 keeps the streams of earlier runs
        relabel = rng.random_sample(batch) < label_noise
        labels = np.where(relabel, rng.randint(0, num_classes, size=batch), labels).astype(np.int64)
    return images.astype(np.float32), labels


def label_entropy(label_noise: float, num_classes: int) -> float:
    """Cross-entropy of the best possible classifier under pattern_images' label noise."""
    if not label_noise:
        return 0.0
    other = label_noise / num_classes
    right = 1.0 - label_noise + other
    return float(-right * np.log(right) - (num_classes - 1) * other * np.log(other))
