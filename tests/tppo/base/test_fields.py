from dataclasses import dataclass

import pytest

from tppo.base.fields import ConfigError, check_fields, spec, with_assignments


@dataclass(frozen=True)
class _Knobs:
    steps: int = spec(3, ge=1)
    rate: float = 0.5
    verbose: bool = False
    name: str = "a"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.rate > 1:
            raise ValueError(f"rate must be <= 1, got {self.rate}")


def test_assignments_are_read_as_each_fields_type():
    base = _Knobs()
    new = with_assignments(base, ["steps=7", "rate=0.25", "verbose=True", "name=b=c"], "--set")
    assert new == _Knobs(steps=7, rate=0.25, verbose=True, name="b=c")
    assert base == _Knobs()  # a copy: the original is untouched
    assert with_assignments(new, ["verbose=off", "rate=1"], "--set") == _Knobs(7, 1.0, False, "b=c")


@pytest.mark.parametrize(
    ("item", "message"),
    [
        ("steps", "--set 'steps': expected KEY=VALUE"),
        ("nope=1", "--set nope: not a field, expected one of name, rate, steps, verbose"),
        ("seed=1", "--set seed: set it with --seed"),
        ("steps=1.5", "--set steps: expected an integer, got '1.5'"),
        ("rate=fast", "--set rate: expected a number, got 'fast'"),
        ("verbose=ture", "--set verbose: expected true or false, got 'ture'"),
        ("rate=2", "rate must be <= 1, got 2.0"),
    ],
)
def test_bad_assignments_name_the_problem(item, message):
    with pytest.raises(ValueError) as err:
        with_assignments(_Knobs(), [item], "--set", reserved={"seed": "--seed"})
    assert str(err.value) == message


def test_declared_rules_stay_the_callers_check():
    new = with_assignments(_Knobs(), ["steps=0"], "--set")
    with pytest.raises(ConfigError, match=r"steps=0 is not allowed: expected a value >= 1"):
        check_fields(new)
