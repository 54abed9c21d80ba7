def split_params_into_different_moe_groups_for_optimizer(param_groups, max_group_size=178956971):
    """Without MoE layers (uckpt has none) the groups stay as they are."""
    if isinstance(param_groups, tuple):
        return list(param_groups)
    if isinstance(param_groups, dict):
        return [param_groups]
    return param_groups
