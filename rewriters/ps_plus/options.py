"""PS+'s options (--staleness_lr, --max_staleness, --ps_plus_sparse_pull)."""
import dataclasses

from parallax_tf.errors import ConfigError
from parallax_tf.strategy import option


@dataclasses.dataclass
class PSPlusOptions:
    staleness_lr: str = option("inverse", "staleness_lr", "ps_plus: learning rate of a push computed on a copy tau "
                               "versions old: inverse (lr / max(1, tau)), none (plain async), exp:GAMMA (lr * "
                               "GAMMA**tau).")
    max_staleness: int = option(16, "max_staleness", "ps_plus: a rank whose copy is more than this many versions "
                                "behind the global one waits for a fresh pull before its next step (bounded "
                                "staleness).")
    sparse_pull: str = option("rows", "ps_plus_sparse_pull", "ps_plus: a sparse variable's rows are read from its "
                              "server in the step (rows), or the whole variable is pulled into a local copy like a "
                              "dense one (eager).", choices=("rows", "eager"))

    def check(self) -> None:
        self.rule()
        if self.max_staleness < 0:
            raise ConfigError(f"--max_staleness must be >= 0 (0: every step waits for the newest values), "
                              f"got {self.max_staleness}")

    def rule(self):
        """(rule, gamma) of --staleness_lr: inverse | none | exp:GAMMA with 0 < GAMMA <= 1."""
        text = self.staleness_lr
        if text in ("inverse", "none"):
            return text, 1.0
        if text.startswith("exp:"):
            try:
                gamma = float(text[4:])
            except ValueError:
                gamma = -1.0
            if 0.0 < gamma <= 1.0:
                return "exp", gamma
        raise ConfigError(f"--staleness_lr={text!r}: use inverse (lr / max(1, tau)), none (plain async) or "
                          "exp:GAMMA with 0 < GAMMA <= 1 (lr * GAMMA**tau), e.g. exp:0.9")
