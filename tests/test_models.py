"""The reference models' generated data: label noise gives the loss floor the benchmarks compare
strategies against."""
import numpy as np

from models import cnn, data, mlp
from parallax_tf.model import RunContext


def test_label_noise_relabels_the_given_fraction_and_the_floor_is_the_ideal_cross_entropy():
    classes, noise, batch = 10, 0.3, 200_000
    rng = np.random.RandomState(5)
    _, clean = data.pattern_images(np.random.RandomState(5), batch, classes, 4, 4, 1, seed=0)
    _, noisy = data.pattern_images(rng, batch, classes, 4, 4, 1, seed=0, label_noise=noise)
    # relabelled with probability 0.3, to a uniform class: the label changes with 0.3 * 9/10
    assert abs(np.mean(clean != noisy) - noise * (classes - 1) / classes) < 0.005
    # the best classifier predicts the label distribution given the pattern's class
    right = 1 - noise + noise / classes
    ideal = np.where(clean == noisy, -np.log(right), -np.log(noise / classes))
    assert abs(np.mean(ideal) - data.label_entropy(noise, classes)) < 0.01
    assert abs(data.label_entropy(noise, classes) - 1.1765) < 1e-4
    assert data.label_entropy(0.0, classes) == 0.0


def test_without_label_noise_the_batches_are_unchanged():
    """label_noise 0 draws nothing extra: earlier runs' figures stay comparable."""
    ctx = RunContext(1, 2, 0, 1, 3)
    plain, noisy_off = cnn.make_input_fn()(ctx), cnn.make_input_fn(label_noise=0.0)(ctx)
    for key in plain:
        np.testing.assert_array_equal(plain[key], noisy_off[key])
    rows = mlp.make_input_fn(features=8, vocab=4, batch=4000, label_noise=0.5)(ctx)
    clean = mlp.make_input_fn(features=8, vocab=4, batch=4000)(ctx)
    np.testing.assert_array_equal(rows["features"], clean["features"])
    # Gaussian noise of standard deviation 0.5 on the targets: the MSE floor is 0.25
    assert abs(np.mean((rows["labels"] - clean["labels"]) ** 2) - 0.25) < 0.02
