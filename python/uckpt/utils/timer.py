"""deepspeed.utils.timer.ThroughputTimer, as the engine's `tput_timer`: the epoch count scripts update
(DeepSpeed-Chat calls engine.tput_timer.update_epoch_count() after each epoch). uckpt's engine keeps no
throughput timings: what reads or drives them is refused by name."""


class ThroughputTimer:

    def __init__(self, batch_size=None):
        self.batch_size = 1 if batch_size is None else batch_size
        self.epoch_count = 0

    def update_epoch_count(self):
        self.epoch_count += 1

    def _refused(self, name):
        raise NotImplementedError(f"engine.tput_timer.{name}: uckpt's engine keeps no throughput timings "
                                  f"(DeepSpeed's timer logs samples/s; only update_epoch_count() and epoch_count "
                                  f"are kept)")

    def start(self):
        self._refused("start()")

    def stop(self, global_step=False, report_speed=True):
        self._refused("stop()")

    def avg_samples_per_sec(self):
        self._refused("avg_samples_per_sec()")
