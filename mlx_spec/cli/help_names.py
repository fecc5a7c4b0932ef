"""Value names for `--help` that a person reads: `X≥0`, `N`, `TEXT`, nothing for a flag,
where Typer would print its own type names (`<bool>`, `<float range> [x>=0.0]`,
`<list[str]>`, `<str>`). Applied once to every parameter of the click command tree that has
no metavar of its own (`readable_value_names`); an explicit metavar is kept as written.
"""

from __future__ import annotations


def _number(value) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def _range(low, high, name: str) -> str:
    """`X≥0`, `N≤8`, `1..64` for a parameter's bounds (the name alone where there are none)."""
    if low is not None and high is not None:
        return f"{_number(low)}..{_number(high)}"
    if low is not None:
        return f"{name}≥{_number(low)}"
    if high is not None:
        return f"{name}≤{_number(high)}"
    return name


def value_name(param) -> str:
    """What `--help` calls the value of `param`: '' for a flag (it takes none)."""
    if param.param_type_name == "option" and (getattr(param, "is_flag", False) or getattr(param, "count", False)):
        return ""
    descriptor = getattr(param, "type_descriptor", None)  # newer Typer; older ones keep click's `type`
    if descriptor is not None:
        kind, choices = param.bare_type().lower(), (descriptor.choices if descriptor.is_choice else None)
        low, high = getattr(param, "min", None), getattr(param, "max", None)
    else:
        kind, choices = type(param.type).__name__.lower(), getattr(param.type, "choices", None)
        low, high = getattr(param.type, "min", None), getattr(param.type, "max", None)
    repeated = "..." if getattr(param, "multiple", False) or param.nargs != 1 or kind.startswith("list") else ""
    if choices:
        return "|".join(str(getattr(c, "value", c)) for c in choices) + repeated
    if "int" in kind:
        name = _range(low, high, "N")
    elif "float" in kind:
        name = _range(low, high, "X")
    elif "path" in kind or "file" in kind:
        name = "PATH"
    elif param.param_type_name == "argument":
        name = (param.name or "value").upper()
    else:
        name = "TEXT"
    return name + repeated


def readable_value_names(command) -> None:
    """Give every parameter of `command` and its subcommands, `--help` included, a readable
    value name."""
    for param in command.params:
        _name(param)
    make_help_option = command.get_help_option

    def get_help_option(ctx):  # click makes `--help` per context, outside `params`
        option = make_help_option(ctx)
        if option is not None:
            _name(option)
        return option

    command.get_help_option = get_help_option
    for sub in getattr(command, "commands", {}).values():
        readable_value_names(sub)


def _bounds(param):
    descriptor = getattr(param, "type_descriptor", None)
    holder = param if descriptor is not None else getattr(param, "type", None)
    return getattr(holder, "min", None), getattr(holder, "max", None)


def _name(param) -> None:
    if getattr(param, "_readable_name", False):  # a group inside a group: walked twice
        return
    param._readable_name = True
    if param.param_type_name == "argument":
        name = ""  # its name column says it already
    elif param.metavar is None:
        name = param.metavar = value_name(param)
    else:  # our own name, with the bounds in the same words: GB≥0, 2..8
        name = param.metavar = _range(*_bounds(param), param.metavar)
    # Newer Typer prints the type column from display_type_rich (an argument's even where it
    # has a metavar), then the bounds, which the name now states.
    if hasattr(param, "display_type_rich"):
        param.display_type_rich = lambda ctx, name=name: name
    if hasattr(param, "_get_number_range_help_str"):
        param._get_number_range_help_str = lambda: None
