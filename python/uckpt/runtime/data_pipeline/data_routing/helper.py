"""deepspeed.runtime.data_pipeline.data_routing.helper: importable, refused where used (uckpt has no random-LTD)."""


def _refuse(what):
    raise NotImplementedError(f"uckpt: {what}: random-LTD (random layerwise token dropping) is not supported by uckpt")


def convert_to_random_ltd(model, convert_type):
    _refuse("convert_to_random_ltd")


def save_without_random_ltd(model):
    _refuse("save_without_random_ltd")


def remove_random_ltd_state_dict(state_dict):
    _refuse("remove_random_ltd_state_dict")
