def split_params_into_different_moe_groups_for_optimizer(param_groups, max_group_size=178956971):
    """DeepSpeed's: the param groups as a list (a dict is one group, a tuple becomes a list; anything else is a
    ValueError). uckpt has no MoE parameters, so no expert groups are split off."""
    if isinstance(param_groups, tuple):
        return list(param_groups)
    if isinstance(param_groups, dict):
        return [param_groups]
    if not isinstance(param_groups, list):
        raise ValueError(f"Unknown param group type of {type(param_groups)}")
    return param_groups
