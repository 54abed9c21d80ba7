"""deepspeed.utils: the logger and log_dist that scripts import."""
import logging

import torch.distributed

logger = logging.getLogger("uckpt")
if not logger.handlers:
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("[%(asctime)s] [%(levelname)s] %(message)s"))
    logger.addHandler(_handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


def log_dist(message, ranks=None, level=logging.INFO):
    """Logs on the given ranks (all when ranks is None or contains -1)."""
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    if ranks is None or -1 in ranks or rank in ranks:
        logger.log(level, f"[Rank {rank}] {message}")
