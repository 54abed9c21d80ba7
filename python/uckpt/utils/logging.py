"""deepspeed.utils.logging: one logger on stdout, and log_dist with DeepSpeed 0.14.5's rank rule."""
import logging
import sys

log_levels = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR,
              "critical": logging.CRITICAL}


def _make_logger(name):
    log = logging.getLogger(name)
    if not log.handlers:
        handler = logging.StreamHandler(stream=sys.stdout)
        handler.setFormatter(logging.Formatter("[%(asctime)s] [%(levelname)s] "
                                               "[%(filename)s:%(lineno)d:%(funcName)s] %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False
    return log


logger = _make_logger("uckpt")
_warned = set()


def warning_once(*args, **kwargs):
    """logger.warning, once per distinct message."""
    key = (args, tuple(sorted(kwargs.items())))
    if key not in _warned:
        _warned.add(key)
        logger.warning(*args, **kwargs)


logger.warning_once = warning_once


def log_dist(message, ranks=None, level=logging.INFO):
    """As DeepSpeed's: without torch.distributed every call logs (as rank -1); with it, only the ranks in
    `ranks` log, or all when ranks[0] is -1 (ranks=None logs nothing)."""
    import torch.distributed as dist
    initialized = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if initialized else -1
    ranks = ranks or []
    if not initialized or (ranks and (ranks[0] == -1 or rank in set(ranks))):
        logger.log(level, f"[Rank {rank}] {message}")
