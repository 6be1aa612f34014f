"""Slim-DP's options (the slim_* flags)."""
import dataclasses

from parallax_tf.errors import ConfigError
from parallax_tf.strategy import option


@dataclasses.dataclass
class SlimOptions:
    core: float = option(0.1, "slim_core", "slim_dp: fraction of each dense variable in the core (significant) set.")
    explore: float = option(0.08, "slim_explore", "slim_dp: fraction of each dense variable explored per round.")
    refresh: int = option(10, "slim_refresh", "slim_dp: rounds between core-set refreshes.")
    period: int = option(1, "slim_period", "slim_dp: local steps per communication round.")
    update_weight: float = option(1.0, "slim_lambda", "slim_dp: weight of the last aggregated update in the "
                                  "significance score.")
    error_feedback: bool = option(True, "slim_error_feedback", "slim_dp: keep the unsent part of a rank's accumulated "
                                  "gradient and add it to the next round's (--noslim_error_feedback: drop it).")

    def check(self) -> None:
        if not (0.0 <= self.core <= 1.0 and 0.0 <= self.explore <= 1.0 and self.core + self.explore <= 1.0):
            raise ConfigError(f"--slim_core ({self.core}) and --slim_explore ({self.explore}) are fractions of each "
                              "variable: each in [0, 1], and together at most 1")
        if self.period < 1 or self.refresh < 1 or self.update_weight < 0:
            raise ConfigError("--slim_period and --slim_refresh must be >= 1 and --slim_lambda >= 0")
