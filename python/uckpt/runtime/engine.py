"""deepspeed.runtime.engine: the engine class initialize() returns (for isinstance checks)."""
from uckpt._uckpt import Engine as DeepSpeedEngine  # noqa: F401
