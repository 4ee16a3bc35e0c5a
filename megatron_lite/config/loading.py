"""Reading, checking and writing configs: YAML load/save, ``--set`` overrides, validation, docs.

A file may inherit from another through its top-level ``base:`` key (``read_chain``, ``merge_under``).
User errors (unknown key, wrong type, impossible value) raise ``ValueError`` naming the dotted key
and the offending value; unknown keys come with the closest valid name. ``docs/config.md`` is
generated from the schema's help texts (``python -m megatron_lite.config --doc``) and a test keeps
the two in sync.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import reprlib
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from megatron_lite.config.schema import EXPERIMENTAL, TEST_HOOKS, USER_KEYS, Config, MixConfig, ModelConfig
from megatron_lite.config.provenance import key_sources, missing_file_message, source_of, with_source
from megatron_lite.config.scaling_spec import parse_scaling
from megatron_lite.console import notice

BASE_KEY = "base"  # top-level key of a config or mix file naming the file it inherits from
# Bounds on what a config, mix file or --set value may make this process read, build and print. The
# shipped files are < 4 KiB and a few hundred YAML nodes; PyYAML parses ~125 KB/s, so 1 MiB is seconds.
MAX_YAML_BYTES = 1 << 20
MAX_YAML_NODES = 1_000_000  # with aliases expanded: what walking, copying or printing the value visits
MAX_SHOWN_CHARS = 200  # of a value in an error message


def _bounded_repr() -> reprlib.Repr:
    shortened = reprlib.Repr()
    shortened.maxlevel, shortened.maxlist, shortened.maxdict, shortened.maxtuple = 3, 8, 8, 8
    shortened.maxstring = shortened.maxother = shortened.maxlong = MAX_SHOWN_CHARS
    return shortened


_BOUNDED_REPR = _bounded_repr()


def short_repr(value: Any) -> str:
    """``repr(value)`` for an error message: at most ~MAX_SHOWN_CHARS characters, elided with '...', and
    built without walking all of a large value (reprlib stops at a few items and levels)."""
    text = _BOUNDED_REPR.repr(value)
    return text if len(text) <= MAX_SHOWN_CHARS else text[: MAX_SHOWN_CHARS - 3] + "..."


# ----------------------------------------------------------------------------------------------
# Parsing with type checks


def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _describe(value: Any) -> str:
    return f"{short_repr(value)} ({type(value).__name__})"


def _coerce(value: Any, annotation: Any, key: str) -> Any:
    """Check/convert one YAML value against a field annotation; ValueError names the key."""
    if annotation is Any:  # passthrough blocks (train.deepspeed) are DeepSpeed's to check
        return value
    origin = typing.get_origin(annotation)
    if origin is list:
        (item_type,) = typing.get_args(annotation)
        if not isinstance(value, list):
            raise ValueError(f"{key}={_describe(value)}: expected a list")
        return [_coerce(item, item_type, f"{key}[{index}]") for index, item in enumerate(value)]
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(annotation)
        if value is None and type(None) in options:
            return None
        non_none = [option for option in options if option is not type(None)]
        errors = []
        for option in non_none:
            try:
                return _coerce(value, option, key)
            except ValueError as error:
                errors.append(str(error))
        raise ValueError(errors[0])
    if origin is Literal:
        choices = typing.get_args(annotation)
        if value not in choices:
            raise ValueError(f"{key}={short_repr(value)}: must be one of {', '.join(map(repr, choices))}"
                             f"{_choice_hint(key, value)}")
        return value
    if origin is dict:
        key_type, value_type = typing.get_args(annotation)
        if not isinstance(value, dict):
            raise ValueError(f"{key}={_describe(value)}: expected a mapping")
        parsed = {}
        for raw_name, item in value.items():
            name = _coerce(raw_name, key_type, f"{key} key")
            if len(str(name)) > MAX_SHOWN_CHARS:  # names go into messages: groups.NAME.weight=...
                raise ValueError(f"{key} key {short_repr(name)}: longer than {MAX_SHOWN_CHARS} characters")
            parsed[name] = _coerce(item, value_type, f"{key}.{name}")
        return parsed
    if dataclasses.is_dataclass(annotation):
        if not isinstance(value, dict):
            raise ValueError(f"{key}={_describe(value)}: expected a mapping of {annotation.__name__} keys")
        return _from_dict(annotation, value, key + ".")
    if annotation is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{key}={_describe(value)}: expected true or false")
        return value
    if annotation is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{key}={_describe(value)}: expected an integer")
        if not -(2**63) <= value < 2**63:  # keeps every later message that prints it short
            raise ValueError(f"{key}={short_repr(value)}: out of range (a 64-bit integer)")
        return value
    if annotation is float:
        # PyYAML reads "1e-5" (no dot) as a string; accept numeric strings for float fields.
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{key}={_describe(value)}: expected a number")
        return float(value)
    if annotation is str:
        if not isinstance(value, str):
            raise ValueError(f"{key}={_describe(value)}: expected a string")
        return value
    raise TypeError(f"unsupported annotation {annotation!r} for {key}")  # a bug in this module


def parse_dataclass(cls: type, data: dict[str, Any], prefix: str = "") -> Any:
    """Build dataclass ``cls`` from a mapping with type checks; errors name ``prefix + key``."""
    return _from_dict(cls, data, prefix)


def _from_dict(cls: type, data: dict[str, Any], prefix: str = "") -> Any:
    annotations = _field_types(cls)
    valid = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        if key not in valid:
            close = difflib.get_close_matches(str(key), valid, n=1, cutoff=0.5)
            hint = f"; did you mean {prefix}{close[0]}?" if close else f"; valid keys: {', '.join(valid)}"
            shown = key if len(str(key)) <= MAX_SHOWN_CHARS else short_repr(key)
            raise ValueError(f"unknown config key {prefix}{shown}{hint}")
        kwargs[key] = _coerce(value, annotations[key], prefix + key)
    return cls(**kwargs)


# ----------------------------------------------------------------------------------------------
# Cross-field validation


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _validate_train(config: Config) -> None:
    """Single-field checks of train.*; the batch triple needs the world size (training/deepspeed_config.py)."""
    train = config.train
    positive = ["train_micro_batch_size_per_gpu", "log_interval", "eval_iters",
                "keep_last_checkpoints", "max_consecutive_nonfinite", "max_consecutive_failed_saves"]
    optional = [name for name in ("train_iters", "train_batch_size", "gradient_accumulation_steps", "exit_interval")
                if getattr(train, name) is not None]
    for name in positive + optional:
        value = getattr(train, name)
        _require(value > 0, f"train.{name}={value}: must be positive")
    for name in ("eval_interval", "save_interval", "num_workers"):
        _require(getattr(train, name) >= 0, f"train.{name}={getattr(train, name)}: must be >= 0")
    full = train.fault_injection.disk_full_bytes
    _require(full >= 0, f"train.fault_injection.disk_full_bytes={full}: must be >= 0")
    _require(train.train_epochs > 0, f"train.train_epochs={train.train_epochs}: must be positive")
    _require(train.zero_stage in (0, 1, 2, 3), f"train.zero_stage={train.zero_stage}: must be 0, 1, 2 or 3")
    _require(not (train.cuda_graphs and train.sequence_parallel_size > 1),
             f"train.cuda_graphs=true: not with train.sequence_parallel_size={train.sequence_parallel_size} (the "
             "all-to-all around each block's attention has not been tried inside CUDA graphs)")
    blocks, layers = train.compile_blocks_per_region, config.model.num_layers
    _require(blocks >= 1 and layers % blocks == 0,
             f"train.compile_blocks_per_region={blocks}: must be a positive divisor of model.num_layers={layers}")
    _require(blocks == 1 or train.compile_mode == "regional",
             f"train.compile_blocks_per_region={blocks}: groups regionally compiled blocks, not with "
             f"train.compile_mode={train.compile_mode}")
    _validate_sequence_parallel(config)
    _validate_extrapolation_eval(config)
    _validate_profile(config)
    _require(train.lr > 0, f"train.lr={train.lr}: must be positive")
    _require(0 <= train.min_lr <= train.lr, f"train.min_lr={train.min_lr}: must be in [0, train.lr={train.lr}]")
    _require(0 <= train.warmup_start_lr <= train.lr,
             f"train.warmup_start_lr={train.warmup_start_lr}: must be in [0, train.lr={train.lr}]")
    _require(0 <= train.warmup < 1, f"train.warmup={train.warmup}: must be a fraction in [0, 1)")
    for name in ("adam_beta1", "adam_beta2"):
        _require(0 <= getattr(train, name) < 1, f"train.{name}={getattr(train, name)}: must be in [0, 1)")
    _require(train.adam_eps > 0, f"train.adam_eps={train.adam_eps}: must be positive")
    _require(train.weight_decay >= 0, f"train.weight_decay={train.weight_decay}: must be >= 0")
    _require(train.gradient_clipping >= 0, f"train.gradient_clipping={train.gradient_clipping}: must be >= 0")
    if train.peak_tflops is not None:
        _require(train.peak_tflops > 0, f"train.peak_tflops={train.peak_tflops}: must be positive")
    _validate_stages(config)


def _validate_sequence_parallel(config: Config) -> None:
    """train.sequence_parallel_size against the model; the world size is checked when training starts."""
    size, model = config.train.sequence_parallel_size, config.model
    _require(size >= 1, f"train.sequence_parallel_size={size}: must be >= 1")
    _require(model.num_attention_heads % size == 0,
             f"train.sequence_parallel_size={size} does not divide model.num_attention_heads="
             f"{model.num_attention_heads} (each rank attends over heads / P heads)")
    _require(model.seq_length % size == 0,
             f"train.sequence_parallel_size={size} does not divide model.seq_length={model.seq_length} "
             "(each rank holds seq_length / P tokens)")


def _validate_extrapolation_eval(config: Config) -> None:
    """train.extrapolation_eval.*, checked even while it is off (interval 0), so turning it on cannot fail late."""
    section, key = config.train.extrapolation_eval, "train.extrapolation_eval"
    _require(section.interval >= 0, f"{key}.interval={section.interval}: must be >= 0 (0 turns it off)")
    for name in ("max_books", "batch_size"):
        _require(getattr(section, name) > 0, f"{key}.{name}={getattr(section, name)}: must be positive")
    _require(section.max_seconds > 0, f"{key}.max_seconds={section.max_seconds}: must be positive")
    _require(bool(section.windows) and all(window > 0 for window in section.windows) and 1 in section.windows,
             f"{key}.windows={section.windows}: positive multiples of model.seq_length, 1 among them")
    _require(len(set(section.windows)) == len(section.windows), f"{key}.windows={section.windows}: repeats a window")
    _require(section.scored_tokens_per_book > 0,
             f"{key}.scored_tokens_per_book={section.scored_tokens_per_book}: must be positive")
    _require(bool(section.books.strip()), f"{key}.books is empty: name the held-out books")
    for index, text in enumerate(section.scalings):
        spec = parse_scaling(text, f"{key}.scalings[{index}]")
        _require(spec.type != "none", f"{key}.scalings[{index}]=none: the model's own scaling is always evaluated")


def _validate_profile(config: Config) -> None:
    """train.profile.*, checked while it is off too."""
    section, key = config.train.profile, "train.profile"
    _require(section.start_step >= 0, f"{key}.start_step={section.start_step}: must be >= 0 (0 turns it off)")
    _require(section.steps > 0, f"{key}.steps={section.steps}: must be positive")
    _require(section.row_limit > 0, f"{key}.row_limit={section.row_limit}: must be positive")
    _require(bool(section.ranks) and all(rank >= 0 for rank in section.ranks),
             f"{key}.ranks={section.ranks}: name at least one global rank (>= 0)")


def _validate_stages(config: Config) -> None:
    """train.stages entries one by one (patterns are checked against the model when training starts),
    and train.train_iters against their sum."""
    train = config.train
    for index, stage in enumerate(train.stages):
        key = f"train.stages[{index}]"
        _require(stage.steps > 0, f"{key}.steps={stage.steps}: must be positive")
        _require(bool(stage.trainable), f"{key}.trainable=[]: name at least one parameter pattern (e.g. '*')")
        for position, pattern in enumerate(stage.trainable):
            _require(bool(pattern.strip()), f"{key}.trainable[{position}]={short_repr(pattern)}: empty pattern")
        if stage.lr is not None:
            _require(stage.lr > 0, f"{key}.lr={stage.lr}: must be positive")
            _require(train.min_lr <= stage.lr and train.warmup_start_lr <= stage.lr,
                     f"{key}.lr={stage.lr}: must be >= train.min_lr={train.min_lr} and train.warmup_start_lr="
                     f"{train.warmup_start_lr}")
    total = sum(stage.steps for stage in train.stages)
    _require(not train.stages or train.train_iters in (None, total),
             f"train.train_iters={train.train_iters} conflicts with train.stages, whose steps sum to {total}: "
             "leave train.train_iters null")


def _validate_architecture(model: ModelConfig) -> None:
    """Head layout and the family-only keys (GQA, explicit head dim and q/k/v biases are llama's)."""
    if model.kv_channels is None:
        _require(model.hidden_size % model.num_attention_heads == 0,
                 f"model.num_attention_heads={model.num_attention_heads}: must divide model.hidden_size="
                 f"{model.hidden_size} (or set model.kv_channels)")
    else:
        _require(model.kv_channels > 0, f"model.kv_channels={model.kv_channels}: must be positive")
    if model.num_key_value_heads is not None:
        _require(model.num_key_value_heads > 0 and model.num_attention_heads % model.num_key_value_heads == 0,
                 f"model.num_key_value_heads={model.num_key_value_heads}: must divide model.num_attention_heads="
                 f"{model.num_attention_heads}")
    if not model.is_llama:
        fused = ("needs model.architecture=llama (gpt_neox fuses q/k/v per head, with biases, one key/value head "
                 "per query head)")
        _require(model.kv_heads == model.num_attention_heads,
                 f"model.num_key_value_heads={model.num_key_value_heads}: {fused}")
        _require(model.kv_channels in (None, model.hidden_size // model.num_attention_heads),
                 f"model.kv_channels={model.kv_channels}: {fused}")
        _require(not model.qkv_bias, f"model.qkv_bias=true: {fused}")


def validate(config: Config) -> Config:
    """Reject impossible combinations; warn about settings that will be ignored."""
    model = config.model
    for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "vocab_size",
                 "make_vocab_size_divisible_by"):
        value = getattr(model, name)
        _require(value > 0, f"model.{name}={value}: must be positive")
    _validate_architecture(model)
    if model.intermediate_size is not None:
        _require(model.intermediate_size > 0, f"model.intermediate_size={model.intermediate_size}: must be positive")
    if model.max_position_embeddings is not None:
        _require(
            model.max_position_embeddings >= model.seq_length,
            f"model.max_position_embeddings={model.max_position_embeddings}: must be >= "
            f"model.seq_length={model.seq_length}",
        )
    for name in ("attention_dropout", "hidden_dropout"):
        value = getattr(model, name)
        _require(0.0 <= value < 1.0, f"model.{name}={value}: must be in [0, 1)")
    _require(model.layernorm_epsilon > 0, f"model.layernorm_epsilon={model.layernorm_epsilon}: must be positive")
    _require(model.init_method_std > 0, f"model.init_method_std={model.init_method_std}: must be positive")
    _require(
        not (model.attention.backend == "flash" and config.precision == "fp32"),
        "model.attention.backend=flash needs precision bf16 or fp16 (flash-attn has no fp32 kernels), got precision=fp32",
    )
    _require(model.attention.chunk_size > 0, f"model.attention.chunk_size={model.attention.chunk_size}: must be positive")
    _require(
        not model.attention.document_mask or model.attention.backend in ("flex", "reference"),
        f"model.attention.document_mask=true needs model.attention.backend flex or reference, got "
        f"{model.attention.backend!r}",
    )
    _require(
        not (model.attention.backend == "flex" and model.attention_dropout > 0),
        f"model.attention.backend=flex has no attention dropout; model.attention_dropout={model.attention_dropout} "
        "needs sdpa, flash, chunked or reference",
    )

    data = config.data
    _require(0.0 <= data.validation_fraction < 1.0,
             f"data.validation_fraction={data.validation_fraction}: must be in [0, 1)")
    _require(data.num_workers >= 1, f"data.num_workers={data.num_workers}: must be >= 1")
    _require(data.tokenizer.sample_chars > 0, f"data.tokenizer.sample_chars={data.tokenizer.sample_chars}: must be positive")

    _validate_train(config)
    position = model.position
    if model.uses_rotary:
        _require(
            0.0 < position.rotary_pct <= 1.0,
            f"model.position.rotary_pct={position.rotary_pct}: must be in (0, 1]",
        )
        rotary_dims = model.rotary_dims
        _require(
            rotary_dims >= 2 and rotary_dims % 2 == 0,
            f"model.position.rotary_pct={position.rotary_pct}: gives {rotary_dims} rotary dims of head_dim "
            f"{model.head_dim}; rotary dims must be even and >= 2",
        )
        _require(position.rotary_emb_base > 1.0, f"model.position.rotary_emb_base={position.rotary_emb_base}: must be > 1")
        if position.scheme == "coca":
            _require(
                model.head_dim % 2 == 0,
                f"model.num_attention_heads={model.num_attention_heads}: coca needs an even head_dim, "
                f"got {model.head_dim}",
            )
    scaling = position.scaling
    if scaling.type != "none":
        _require(scaling.factor >= 1.0, f"model.position.scaling.factor={scaling.factor}: must be >= 1")
        if scaling.original_max_position_embeddings is not None:
            _require(
                scaling.original_max_position_embeddings > 0,
                "model.position.scaling.original_max_position_embeddings="
                f"{scaling.original_max_position_embeddings}: must be positive",
            )
        if scaling.type == "yarn":
            _require(
                scaling.beta_fast > scaling.beta_slow > 0,
                f"model.position.scaling.beta_fast={scaling.beta_fast}: must exceed beta_slow="
                f"{scaling.beta_slow} > 0",
            )
            _require(scaling.attention_factor is None or scaling.attention_factor > 0,
                     f"model.position.scaling.attention_factor={scaling.attention_factor}: must be positive (or null)")
        if scaling.type == "llama3":
            _require(0 < scaling.low_freq_factor < scaling.high_freq_factor,
                     f"model.position.scaling.low_freq_factor={scaling.low_freq_factor}: must be > 0 and below "
                     f"high_freq_factor={scaling.high_freq_factor}")
        if not model.uses_rotary:
            notice(
                f"model.position.scaling.type={scaling.type} is ignored: scheme {position.scheme} has no rotary embedding",
                stacklevel=2,
            )
    if position.scheme != "coca" and position.constraint != "slack":
        notice(
            f"model.position.constraint={position.constraint} is ignored: only the coca scheme uses it",
            stacklevel=2,
        )
    return config


# ----------------------------------------------------------------------------------------------
# Public API


def from_dict(data: dict[str, Any]) -> Config:
    """Parse and validate a nested mapping (as read from YAML)."""
    if not isinstance(data, dict):
        raise ValueError(f"config must be a mapping at top level, got {type(data).__name__}")
    return validate(_from_dict(Config, data))


def to_dict(config: Config) -> dict[str, Any]:
    return dataclasses.asdict(config)


def parse_override(assignment: str) -> tuple[list[str], Any]:
    """'model.position.scheme=rope' -> (['model', 'position', 'scheme'], 'rope'); value parsed as YAML."""
    where = f"override {short_repr(assignment)}"
    if "=" not in assignment:
        raise ValueError(f"{where}: expected KEY=VALUE, e.g. model.position.scheme=rope")
    key, raw_value = assignment.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise ValueError(f"{where}: empty key component")
    size = len(raw_value.encode())
    if size > MAX_YAML_BYTES:
        raise ValueError(f"{where}: the value is {size:,} bytes, over the limit of {MAX_YAML_BYTES:,}")
    try:
        value = bounded_yaml(raw_value) if raw_value.strip() else None
    except UnboundedYaml as error:
        raise ValueError(f"{where}: {error.problem}") from None
    except yaml.YAMLError as error:
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        raise ValueError(f"{where}: the value is not valid YAML ({problem})") from None
    return parts, value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply dotted KEY=VALUE overrides to a raw mapping; validation happens when it is parsed."""
    for assignment in overrides:
        parts, value = parse_override(assignment)
        node = data
        for depth, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ValueError(f"override {short_repr(assignment)}: {'.'.join(parts[: depth + 1])} is not a section")
            node = child
        node[parts[-1]] = value
    return data


def with_overrides(config: Config, overrides: list[str]) -> Config:
    """A validated copy of ``config`` with ``--set`` style overrides applied."""
    return from_dict(apply_overrides(to_dict(config), overrides))


class UnboundedYaml(yaml.MarkedYAMLError):
    """A YAML document whose aliases expand past MAX_YAML_NODES nodes, or into themselves."""


def _check_expansion(root: yaml.Node) -> None:
    """Refuse a composed document that is small as written but huge (or infinite) with its aliases
    expanded: PyYAML shares an alias's node, so parsing and constructing are cheap, but each later walk
    of the value (checks, copies, an error message) visits every use. One pass, memoised per node:
    expanded(node) = 1 + the sum over its children (a mapping's keys and values)."""
    expanded: dict[int, int] = {}
    open_nodes: set[int] = set()  # on the current path: meeting one again is a recursive alias
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]  # (node, its children are done)
    while stack:
        node, children_done = stack.pop()
        if id(node) in expanded:
            continue
        children: list[yaml.Node] = []
        if isinstance(node, yaml.SequenceNode):
            children = node.value
        elif isinstance(node, yaml.MappingNode):
            children = [part for pair in node.value for part in pair]
        if children_done:
            open_nodes.discard(id(node))
            expanded[id(node)] = 1 + sum(expanded[id(child)] for child in children)
            if expanded[id(node)] > MAX_YAML_NODES:
                raise UnboundedYaml(problem=f"its aliases expand to more than {MAX_YAML_NODES:,} YAML nodes "
                                            "(an alias bomb?)", problem_mark=node.start_mark)
            continue
        if id(node) in open_nodes:
            raise UnboundedYaml(problem="an alias refers to a node that contains it (recursive YAML)",
                                problem_mark=node.start_mark)
        open_nodes.add(id(node))
        stack.append((node, True))
        stack.extend((child, False) for child in children if id(child) not in expanded)


def bounded_yaml(text: str) -> Any:
    """``yaml.safe_load(text)``, refusing (``UnboundedYaml``) before construction a document whose aliases
    expand past MAX_YAML_NODES nodes."""
    loader = yaml.SafeLoader(text)
    try:
        root = loader.get_single_node()
        if root is None:
            return None
        _check_expansion(root)
        return loader.construct_document(root)
    except RecursionError:  # the composer recurses per nesting level
        raise UnboundedYaml(problem="nested deeper than PyYAML can parse") from None
    except ValueError as error:  # from a constructor, e.g. an integer of more than 4,300 digits
        problem = " ".join(str(error).split())[:MAX_SHOWN_CHARS]
        raise yaml.constructor.ConstructorError(problem=problem) from None
    finally:
        loader.dispose()


def read_yaml(path: Path) -> Any:
    """The document in a YAML file (None when empty); a syntax error is one ValueError,
    ``FILE:LINE:COLUMN: problem``, instead of PyYAML's multi-line report. A file over MAX_YAML_BYTES, or
    whose aliases expand past MAX_YAML_NODES nodes, is refused before it is built."""
    size = path.stat().st_size
    if size > MAX_YAML_BYTES:
        raise ValueError(f"{path}: {size:,} bytes, over the limit of {MAX_YAML_BYTES:,} for a config or mix file")
    try:
        return bounded_yaml(path.read_text())
    except yaml.MarkedYAMLError as error:
        mark = error.problem_mark or error.context_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        kind = "refused" if isinstance(error, UnboundedYaml) else "invalid YAML"
        raise ValueError(f"{where}: {kind}: {error.problem or error.context}") from None
    except yaml.YAMLError as error:
        raise ValueError(f"{path}: invalid YAML: {error}") from None
    except UnicodeDecodeError as error:
        raise ValueError(f"{path}: not UTF-8 text (byte {error.start})") from None


def _read_file_mapping(path: Path, missing: str) -> dict[str, Any]:
    """One file's top-level mapping as written (empty for an empty file); ValueError ``missing`` when
    there is no such file, one line for a syntax error or another top level."""
    if not path.is_file():
        raise ValueError(missing)
    data = read_yaml(path) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: top level must be a mapping, got {type(data).__name__}")
    return data


def read_chain(path: Path, missing: str) -> list[tuple[Path, dict[str, Any]]]:
    """``path`` and the files its ``base:`` key names, in turn (each relative to the file naming it):
    ``[(path, its mapping without base), (its base, ...), ...]``. ValueError ``missing`` when ``path``
    does not exist; one line naming the key and file for a missing base, or the chain for a cycle."""
    chain: list[tuple[Path, dict[str, Any]]] = []
    seen: list[Path] = []  # resolved, to catch a cycle however the paths are spelled
    while True:
        data = _read_file_mapping(path, missing)
        seen.append(path.resolve())
        chain.append((path, data))
        if BASE_KEY not in data:
            return chain
        name = data.pop(BASE_KEY)
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"{path}: {BASE_KEY}={_describe(name)}: expected the path of a YAML file, relative "
                             f"to {path.parent}")
        base = Path(os.path.normpath(path.parent / name))
        if base.resolve() in seen:
            names = " -> ".join(str(file) for file, _ in chain)
            raise ValueError(f"{path}: {BASE_KEY}={short_repr(name)} makes a cycle: {names} -> {base}")
        missing = "" if base.is_file() else \
            f"{path}: {BASE_KEY}={short_repr(name)}: " + missing_file_message(base, "file")
        path = base


def merge_under(base: dict[str, Any], child: dict[str, Any]) -> dict[str, Any]:
    """``child`` laid over ``base``: mappings present in both merge key by key; any other child value
    (a scalar, a list, null) replaces the base's. Neither argument is modified."""
    merged = dict(base)
    for key, value in child.items():
        below = merged.get(key)
        merged[key] = merge_under(below, value) if isinstance(below, dict) and isinstance(value, dict) else value
    return merged


def merge_chain(chain: list[tuple[Path, dict[str, Any]]]) -> dict[str, Any]:
    """A ``read_chain`` merged: each file's own keys over its base's."""
    merged: dict[str, Any] = {}
    for _, data in reversed(chain):
        merged = merge_under(merged, data)
    return merged


def _choice_hint(key: str, value: Any) -> str:
    """What a refused choice most likely meant, where a name suggests it: CoCA's two variants are one scheme,
    ``coca``, and a constraint (the config files' names coca_strict / coca_slack are not scheme names)."""
    if key == "model.position.scheme" and isinstance(value, str) and value.startswith("coca_"):
        constraint = value.removeprefix("coca_")
        constraint = constraint if constraint in ("strict", "slack") else "strict|slack"
        return (f"; CoCA's variant is model.position.constraint: --set model.position.scheme=coca "
                f"--set model.position.constraint={constraint}")
    return ""


def read_yaml_mapping(path: Path, missing: str) -> dict[str, Any]:
    """The top-level mapping of a YAML config or mix file with its ``base:`` chain merged in (the file's
    own keys over its base's, see ``read_chain``); empty for an empty file."""
    return merge_chain(read_chain(path, missing))


def load(path: str | Path, overrides: list[str] | None = None) -> Config:
    """Read a YAML config, apply ``--set`` style overrides, validate. A value the checks refuse is reported
    under where it came from: ``--set KEY=VALUE``, the config file, or the base file that set it."""
    path, overrides = Path(path), overrides or []
    chain = read_chain(path, "" if path.is_file() else missing_file_message(path, "config file"))
    merged = merge_chain(chain)
    if not merged:  # it would train every default (a 400M model on the default data): surely not what was meant
        raise ValueError(f"{path}: empty config (no keys); give one such as configs/tiny/coca_slack.yml or "
                         "configs/coca_350m.yml, or start yours with `base: FILE`")
    data = apply_overrides(merged, overrides)  # its errors name the override
    try:
        return from_dict(data)
    except ValueError as error:
        assignments = [(assignment if len(assignment) <= MAX_SHOWN_CHARS else short_repr(assignment),
                        *parse_override(assignment)) for assignment in overrides]
        source = source_of(str(error), key_sources(chain, assignments), path)
        raise ValueError(with_source(str(error), source)) from None


def save(config: Config, path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as handle:
        yaml.safe_dump(to_dict(config), handle, sort_keys=False)


def _reference_rows(root: type) -> list[tuple[str, str]]:
    """(section, markdown table row) of every key of ``root`` in schema order: a key is in its field's section
    (``schema._doc``) or, below a section's own field (``train.fault_injection``), in that field's; an
    experimental value of a key (``experimental_values``) gets a row of its own among the experimental keys."""
    rows: list[tuple[str, str]] = []

    def walk(cls: type, prefix: str, inherited: str) -> None:
        annotations = _field_types(cls)
        for item in dataclasses.fields(cls):
            annotation = annotations[item.name]
            section = item.metadata.get("section", USER_KEYS) if inherited == USER_KEYS else inherited
            key, help_text = f"{prefix}{item.name}", _cell(item.metadata["help"])
            if dataclasses.is_dataclass(annotation):
                walk(annotation, f"{key}.", section)
                continue
            if typing.get_origin(annotation) is dict and dataclasses.is_dataclass(typing.get_args(annotation)[1]):
                rows.append((section, f"| `{key}` | mapping | – | {help_text} |"))
                walk(typing.get_args(annotation)[1], f"{key}.NAME.", section)
                continue
            if typing.get_origin(annotation) is list and dataclasses.is_dataclass(typing.get_args(annotation)[0]):
                rows.append((section, f"| `{key}` | list | `[]` | {help_text} |"))
                walk(typing.get_args(annotation)[0], f"{key}[].", section)
                continue
            if item.default is not dataclasses.MISSING:
                default = item.default
            elif item.default_factory is not dataclasses.MISSING:
                default = item.default_factory()
            else:
                default = "required"
            type_name = " \\| ".join(map(str, typing.get_args(annotation))) if typing.get_origin(annotation) is Literal \
                else str(annotation).replace("typing.", "").replace("|", "\\|")
            if isinstance(annotation, type):
                type_name = annotation.__name__
            rows.append((section, f"| `{key}` | {type_name} | `{default}` | {help_text} |"))
            for value, why in item.metadata.get("experimental_values", {}).items():
                rows.append((EXPERIMENTAL, f"| `{key}: {value}` | value | `{default}` | {_cell(why)} |"))

    walk(root, "", USER_KEYS)
    return rows


def documentation(root: type | None = None, section: str = USER_KEYS) -> str:
    """Markdown table of the keys of ``root`` (default Config) in ``section`` (schema.USER_KEYS, EXPERIMENTAL or
    TEST_HOOKS): type, default, help text."""
    lines = ["| key | type | default | meaning |", "|---|---|---|---|"]
    lines += [row for row_section, row in _reference_rows(root or Config) if row_section == section]
    return "\n".join(lines) + "\n"


INHERITANCE_DOC = """## Inheritance (`base:`)

A config file may start from another: its top-level `base:` names that file, by a path relative to the
file itself. The base is read first and the file's own keys are laid over it: mappings merge key by key,
and anything else the file gives (a number, a string, a list, null) replaces the base's value whole. A
base may have a base of its own; a cycle or a missing file is refused. `--set` overrides apply last.
Mix files (`configs/data/*.yml`) take `base:` the same way. `python -m megatron_lite.config --config
FILE` prints the resolved config after a comment naming the chain.

`configs/tiny/coca_strict.yml`, all of it:

```yaml
base: coca_slack.yml
model:
  position:
    constraint: strict  # merged into coca_slack.yml's model.position: its scheme, rotary_pct, ... stay
```

Each family of shipped configs has one complete file, its CoCA slack config (`configs/coca_350m.yml`,
`configs/tiny/coca_slack.yml`, `configs/repro/{tiny,speedrun}/coca_slack.yml`); the others give only how
they differ from it.

"""


RUN_CONFIG_DOC = ("The keys a run sets. [Experimental keys](#experimental-keys) and [test hooks](#test-hooks) are "
                  "listed apart, after them.\n\n")
EXPERIMENTAL_DOC = ("Measured not to help on the GPUs tried, or not measured on one: leave them at their defaults. "
                    "They stay so that configs naming them still load; each names its figures.\n\n")
TEST_HOOKS_DOC = ("Failures made on purpose, for the tests of the run's robustness (checkpoint safety, stops, "
                  "non-finite losses); a run never sets them.\n\n")


def _cell(text: str) -> str:
    """Help text as one markdown table cell: a literal '|' would end the cell."""
    return text.replace("|", "\\|")


def documentation_page() -> str:
    """docs/config.md: inheritance, the run config and the mix-file format."""
    return (
        "# Configuration reference\n\nGenerated by `python -m megatron_lite.config --doc`.\n\n" + INHERITANCE_DOC
        + "## Run config (`configs/*.yml`)\n\n" + RUN_CONFIG_DOC + documentation(Config)
        + "\n### Experimental keys\n\n" + EXPERIMENTAL_DOC + documentation(Config, EXPERIMENTAL)
        + "\n### Test hooks\n\n" + TEST_HOOKS_DOC + documentation(Config, TEST_HOOKS)
        + "\n## Mix files (`configs/data/*.yml`, named by `data.mix`)\n\n" + documentation(MixConfig)
    )
