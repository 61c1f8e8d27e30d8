"""Model families: one registry entry per family, as torchtitan's ``ModelSpec``.

An entry says everything the rest of flexpack needs to know about a family: its name, config class
and presets, how a config is built from a preset and overrides, the model class, how a checkpoint's
config and tensors map onto the family's (weight converters), which tensors a checkpoint may lack
and how they start, the block container that ``parallel/`` wraps, compiles and shards block by block,
its default self-attention mask (the others it may train with are the mask table's entries that name the
family: :mod:`flexpack.attention.mask_table`), how many copies of an episode it sees (noisy, or noisy and
clean), the objective it trains with (a class: :mod:`flexpack.flow.objectives`), the data conventions
of its datasets (:class:`DataConventions`: action space, cameras, text length), the sampler (a class,
flexpack's flow solver by default, or none: the family does not sample yet), the config fields that
only say how it samples, the camera composition its checkpoints record, what its checkpoints record beside the
weights and how a load checks it, the export formats it can be written in (:class:`ExportFormat`, each with
its writer) and the action statistics an export records where the family reads them itself. Every entry holds the
callables themselves, never import strings. The run
(:mod:`flexpack.run.root`), the geometry, the collate, the objective and the sampler ask the family; nothing
else branches on a family's name.

A family's code lives in its own folder, ``flexpack/families/<name>/`` (:mod:`flexpack.families`), whose
``spec`` module calls :func:`register`; the registry imports the built-in ones (:data:`BUILTIN`) the first
time a family is asked for, and code outside flexpack registers its own the same way
(``tests/test_toy_family.py``). Nothing else in flexpack imports a family folder (``tests/test_layers.py``).

Every family config offers the shape properties generic code reads (``patch_size``, ``in_channels``,
``out_dim``, ``action_channels``, ``text_dim``, ``dim``, ``num_heads``, ``head_dim``, ``ffn_dim``,
``num_layers``, ``attn_backend``), whatever its own field names are (:class:`ModelShape`).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Protocol

from torch import Tensor, nn

from ..attention.masks import mask_kind, mask_names
from .conventions import Alias, DataConventions


class ModelShape(Protocol):
    """What generic code reads of any family's resolved model config (fields or properties)."""

    @property
    def patch_size(self) -> tuple[int, int, int]: ...
    @property
    def in_channels(self) -> int: ...
    @property
    def out_dim(self) -> int: ...
    @property
    def action_channels(self) -> int: ...
    @property
    def text_dim(self) -> int: ...
    @property
    def dim(self) -> int: ...
    @property
    def num_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def ffn_dim(self) -> int: ...
    @property
    def num_layers(self) -> int: ...
    @property
    def attn_backend(self) -> str: ...


# the attention projections and FFN linears of every Wan block (flexpack.models.wan_blocks.WanBlock)
WAN_BLOCK_LINEARS = ("self_attn.q", "self_attn.k", "self_attn.v", "self_attn.o",
                     "cross_attn.q", "cross_attn.k", "cross_attn.v", "cross_attn.o", "ffn.fc1", "ffn.fc2")

# the family packages flexpack ships; each one's ``spec`` module registers it when imported
BUILTIN = ("flexpack.families.wan.spec", "flexpack.families.lingbot.spec")


def _default_conventions(config: Any) -> DataConventions:
    """A batch's actions are the config's ``action_channels`` wide (at least 1), the dataset's columns in order."""
    return DataConventions(action_dim=max(config.action_channels, 1))


@dataclass(frozen=True, kw_only=True)
class ExportFormat:
    """One format ``flexpack export --format`` writes a family's checkpoint in: its writer (an ``ExportJob``
    and a folder: :mod:`flexpack.tools.export_io`), the check of the checkpoint's ``"export"`` run
    (:func:`flexpack.run.compose.compose`) and the command's options before any weight is read (None: none), the
    module it needs, the flexpack extra that installs it and how to load what it writes (``{out}``: the folder);
    ``options``: the options of ``flexpack export`` only some formats take that
    this one does (an ``ExportOptions`` field: ``policy``, ``wan_pretrained_path``, ``allow_unrunnable``) -> what it
    means here (:data:`flexpack.tools.export_io.FORMAT_OPTIONS`)."""

    writer: Callable[[Any, Any], None]
    check: Callable[[Any, Any], None] | None = None
    package: str = ""
    extra: str = ""
    load: str = ""
    options: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class ModelFamily:
    """One model family (see the module docstring)."""

    name: str
    config_class: type
    presets: Mapping[str, Any]  # preset name -> config
    model_class: type[nn.Module]  # ``model_class(config)`` builds a randomly initialized model
    # override names as configs write them (e.g. ``action_channels``) -> the family's own field
    aliases: Mapping[str, str | Alias] = field(default_factory=dict)
    refused: Mapping[str, str] = field(default_factory=dict)  # override names this family refuses -> why
    # a checkpoint's config.json -> a config of the family's shape (pretrained weights)
    read_checkpoint_config: Callable[[Mapping[str, Any]], Any] | None = None
    shape_fields: tuple[str, ...] = ()  # the fields a checkpoint's config decides
    # fields a checkpoint's config.json gives where it has them and model.overrides does not set them
    checkpoint_defaults: tuple[str, ...] = ()
    # the camera composition a checkpoint's config.json records ("width_concat", "tshape"), None: none; the run
    # checks it against its data's (flexpack.run.pretrained.check_camera_layout)
    checkpoint_layout: Callable[[Mapping[str, Any]], str | None] | None = None
    # (weight files, config.json or None) of a checkpoint file or folder
    checkpoint_files: Callable[[str], tuple[list[str], str | None]] | None = None
    # one checkpoint tensor under the model's name (and shape), or None when the model has no counterpart
    convert_tensor: Callable[[str, Tensor], tuple[str, Tensor] | None] | None = None
    # the tensors a checkpoint of this family may lack, freshly drawn from the global RNG (by name)
    fresh_tensors: Callable[[Any], dict[str, Tensor]] = lambda config: {}
    # a whole checkpoint (file or folder) as a model of ``config``, built without a random init first
    load_checkpoint: Callable[[str, Any], nn.Module] | None = None
    # an export folder of the family (one its exports wrote) as a model of ``config``; None: load_checkpoint reads it
    read_export: Callable[[str, Any], nn.Module] | None = None
    # the transformer blocks parallelize, float8 and checkpointing wrap one by one: the model's attribute holding
    # them (a ModuleList), or a callable of the model giving its ModuleList (block_list reads either)
    blocks: str | Callable[[nn.Module], nn.ModuleList] = "blocks"
    mask: str = "document"  # the default self-attention mask (model.mask = ""); see masks
    copies: int | None = None  # copies of every frame: None = 2 under objective.teacher_forcing, else 1
    # its objective class: ``objective.from_config(objective section, resolved model config)``; None: flexpack's
    # flow matching (flexpack.flow.objectives.FlowObjective)
    objective: Any = None
    # the objective section applied to the resolved config (config, objective section, the field names
    # model.overrides sets) -> config; ValueError for keys that do not apply. None: nothing to apply
    apply_objective: Callable[[Any, Any, frozenset[str]], Any] | None = None
    conventions: Callable[[Any], DataConventions] = _default_conventions  # what its datasets look like
    # how flexpack sample / sample.every sample it: a sampler class (a flexpack.sampling.solver.PackedSampler
    # subclass with its context_chunk(cfg)); None: flexpack's flow solver (PackedSampler) unless samples is False
    sampler: Any = None
    samples: bool = True  # False: flexpack cannot sample this family yet
    # config fields that say how the family samples, not what it trains (a sample may set them; the
    # trained-config check skips them)
    sampling_fields: tuple[str, ...] = ()
    exports: Mapping[str, ExportFormat] = field(default_factory=dict)  # --format name -> how it is written
    # the action statistics an export records where the family reads them from its own data layout (the
    # checkpoint's "export" Run, train_state, the checkpoint's name, export's --dataset or None) -> (statistics,
    # normalization.json's record), or None for flexpack's rule (flexpack.tools.export); None: that rule always
    export_normalization: Callable[[Any, Mapping[str, Any], str, str | None],
                                   tuple[Any, dict[str, Any]] | None] | None = None
    # what a checkpoint records beside the weights (train_state.json), from the model; None: nothing
    weights_record: Callable[[nn.Module], dict[str, Any]] | None = None
    # a checkpoint's train_state (its record), the model, the checkpoint's name -> one ValueError line where the
    # weights cannot be loaded into the model as trained; None: nothing to check
    check_weights: Callable[[Mapping[str, Any], nn.Module, str], None] | None = None
    # lora.targets = [] (the default): the modules LoRA adapts, as peft's target_modules (a module name, or its
    # last dotted parts); () = none by default: a LoRA run of the family names its targets
    lora_targets: tuple[str, ...] = ()

    def config(self, preset: str, **overrides: Any) -> Any:
        """The preset with ``overrides`` (their names as configs write them, aliases resolved)."""
        if preset not in self.presets:
            label = self.config_class.__name__.removesuffix("Config")
            raise ValueError(f"unknown {label} preset {preset!r}; known: {sorted(self.presets)}")
        return dataclasses.replace(self.presets[preset], **self.fields(overrides))

    def fields(self, overrides: Mapping[str, Any]) -> dict[str, Any]:
        """``overrides`` under the family's field names, converted where an :class:`Alias` says so (an
        alias and its field together, and a refused name, are errors)."""
        out: dict[str, Any] = {}
        given: dict[str, str] = {}  # field -> the override key that set it
        for key, value in overrides.items():
            if key in self.refused:
                raise ValueError(f"model.overrides.{key} does not apply to model.family = {self.name!r}: "
                                 f"{self.refused[key]}")
            alias = self.aliases.get(key, key)
            name = alias if isinstance(alias, str) else alias.field
            if name in out:
                raise ValueError(f"model.overrides sets {name} twice (as {given[name]!r} and as {key!r})")
            out[name] = value if isinstance(alias, str) or alias.convert is None else alias.convert(value)
            given[name] = key
        return out

    def field_names(self) -> set[str]:
        """Override names this family takes: its config's fields, the aliases and the refused names
        (refused with their reason by :meth:`fields`)."""
        return {f.name for f in dataclasses.fields(self.config_class)} | set(self.aliases) | set(self.refused)

    def override_type(self, key: str, hints: Mapping[str, Any]) -> Any:
        """The type an override ``key`` must have (``hints``: the config class's type hints)."""
        if key in self.refused:
            return Any
        alias = self.aliases.get(key, key)
        if isinstance(alias, str):
            return hints[alias]
        return hints[alias.field] if alias.type is None else alias.type

    @property
    def masks(self) -> tuple[str, ...]:
        """The self-attention masks (``model.mask``) this family trains with: its default first, then every
        mask of the table that names the family (``MaskKind.families``), in the table's order."""
        return (self.mask, *(m for m in mask_names() if m != self.mask and self.name in mask_kind(m).families))

    @property
    def chunk_masks(self) -> tuple[str, ...]:
        """Its masks that take ``model.chunk_size`` (``MaskKind.chunked``)."""
        return tuple(m for m in self.masks if mask_kind(m).chunked)

    def copies_of(self, teacher_forcing: bool) -> int:
        """Copies of every frame the model sees (:attr:`copies`)."""
        return self.copies if self.copies is not None else 2 if teacher_forcing else 1

    def build(self, config: Any) -> nn.Module:
        return self.model_class(config)

    def block_list(self, model: nn.Module) -> nn.ModuleList:
        """The model's transformer blocks (:attr:`blocks`)."""
        return getattr(model, self.blocks) if isinstance(self.blocks, str) else self.blocks(model)

    @property
    def export_formats(self) -> tuple[str, ...]:
        """The ``--format`` names it can be written in, its default first."""
        return tuple(self.exports)


_FAMILIES: dict[str, Callable[[], ModelFamily]] = {}


def register(name: str, make: Callable[[], ModelFamily]) -> None:
    """Register a family under ``name``; ``make`` builds its entry on first use (imports stay lazy)."""
    _FAMILIES[name] = functools.cache(make)


@functools.cache
def _builtin() -> None:
    for package in BUILTIN:  # each spec module registers its family
        importlib.import_module(package)


def family(name: str) -> ModelFamily:
    """The registered family ``name`` (``model.family``), or a ValueError naming the known ones."""
    _builtin()
    if name not in _FAMILIES:
        raise ValueError(f"model.family must be one of {sorted(_FAMILIES)}, got {name!r}")
    return _FAMILIES[name]()


def families() -> list[str]:
    _builtin()
    return sorted(_FAMILIES)


def family_of(model: nn.Module) -> ModelFamily | None:
    """The family whose model class ``model`` is (the most derived one: a wrapper class such as FSDP2's
    subclasses it), or None."""
    by_class = {}
    for name in families():
        by_class.setdefault(family(name).model_class, family(name))
    return next((by_class[c] for c in type(model).__mro__ if c in by_class), None)
