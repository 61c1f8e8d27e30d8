"""Each family's model class offers only the entry points it supports. WanVA and LingbotVA compute with one shared
backbone (``flexpack.models.backbone.WanBackbone``: parameters, names and the packed forward) and neither subclasses
the other; no public method of a family's model class is an inherited entry point refused by an override (a body
that only raises), which a probe class shows the check catching."""

from __future__ import annotations

import ast
import inspect
import textwrap

import pytest
import torch

from flexpack.families.lingbot.config import lingbot_config
from flexpack.families.lingbot.model import LingbotVA
from flexpack.families.wan.config import wan_config
from flexpack.families.wan.model import WanVA
from flexpack.models.backbone import WanBackbone
from flexpack.models.registry import families, family, family_of


def only_raises(fn) -> bool:
    """Whether ``fn``'s body, past its docstring, is one ``raise`` statement."""
    try:
        source = textwrap.dedent(inspect.getsource(inspect.unwrap(fn)))
    except (OSError, TypeError):  # not Python source (a builtin)
        return False
    (node,) = ast.parse(source).body
    body = node.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        body = body[1:]
    return len(body) == 1 and isinstance(body[0], ast.Raise)


def refused_methods(cls: type) -> set[str]:
    """The public methods ``cls`` has (from flexpack's classes of its MRO, as ``cls`` resolves them) whose body
    only raises."""
    names = {n for k in cls.__mro__ if k.__module__.startswith(("flexpack.", "test_"))
             for n in vars(k) if not n.startswith("_")}
    out = set()
    for name in names:
        value = inspect.getattr_static(cls, name)
        fn = value.__func__ if isinstance(value, (classmethod, staticmethod)) else value
        fn = fn.fget if isinstance(fn, property) else fn
        if callable(fn) and only_raises(fn):
            out.add(name)
    return out


MODEL_CLASSES = sorted({family(n).model_class for n in families()} | {WanVA, LingbotVA}, key=lambda c: c.__name__)


def test_lingbot_va_is_no_wanva_and_both_share_the_backbone():
    assert not issubclass(LingbotVA, WanVA) and not issubclass(WanVA, LingbotVA)
    assert issubclass(LingbotVA, WanBackbone) and issubclass(WanVA, WanBackbone)
    # the entry points of the diffusers family are WanVA's alone
    for name in ("forward_video", "from_diffusers", "from_diffusers_file", "reset_action_stream"):
        assert hasattr(WanVA, name) and not hasattr(LingbotVA, name), name
        assert not hasattr(WanBackbone, name), name


@pytest.mark.parametrize("cls", MODEL_CLASSES, ids=lambda c: c.__name__)
def test_no_family_model_refuses_a_public_method(cls):
    assert refused_methods(cls) == set()


def test_the_refusal_check_catches_an_override_that_only_raises():
    class Refusing(WanVA):
        __module__ = "test_family_models"

        def forward_video(self, latent, timestep, text):
            """Not supported here."""
            raise NotImplementedError("no video-only call")

        @classmethod
        def from_diffusers(cls, model, **kw):
            raise ValueError("loads other weights")

        @torch.no_grad()
        def reset_action_stream(self) -> None:
            raise ValueError("nothing to initialize")

        def supported(self) -> int:
            """Works."""
            return 1

    assert refused_methods(Refusing) == {"forward_video", "from_diffusers", "reset_action_stream"}


def test_each_model_is_found_as_its_own_family():
    """The registry tells the families apart by class (``family_of``), with no subclassing between them."""
    torch.manual_seed(0)
    wan = WanVA(wan_config("tiny", num_layers=1))
    lingbot = LingbotVA(lingbot_config("lingbot-va-tiny", num_layers=1))
    assert family_of(wan).name == "wanva"
    assert family_of(lingbot).name == "lingbot-va"
    assert "action_head_modulation" in dict(wan.named_parameters())
    assert "action_head_modulation" not in dict(lingbot.named_parameters())  # one output table for both streams
