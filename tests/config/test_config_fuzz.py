"""Config fuzzing: over 10,000 generated documents with fixed seeds, every outcome of
load_config is a Config or a ConfigError: never another exception, never a hang, never a
mutated input.

Documents: mutations of the six shared DeepSpeed configs (values of every type, NaN/inf, huge
numbers, non-string keys, typos, deep nesting, self-references, shared sub-trees that expand
exponentially), YAML and JSON text (tags, anchors and aliases, complex keys, deep brackets,
truncation, stray bytes, duplicate keys) and random trees of known and unknown keys.
"""

import copy
import datetime
import glob
import json
import math
import os
import signal
import warnings

import pytest
import yaml
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

import qcompress
from qcompress import ConfigError
from qcompress.config import Config
from tests.helpers.shared_paths import DS_COMPRESSION

FILES = sorted(glob.glob(os.path.join(DS_COMPRESSION, "**", "*.json"), recursive=True))
if len(FILES) != 6:
    pytest.skip(
        f"the six shared DeepSpeed configs are not under {DS_COMPRESSION} (found {len(FILES)})", allow_module_level=True
    )
SHARED = [json.loads(open(f).read()) for f in FILES]
_DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)
SECONDS_PER_DOCUMENT = 10  # "never a hang": far above the ~2 ms a document takes


def _keys(doc, out):
    if isinstance(doc, dict):
        for k, v in doc.items():
            out.add(k)
            _keys(v, out)
    elif isinstance(doc, list):
        for v in doc:
            _keys(v, out)
    return out


KNOWN = sorted(
    set().union(*[_keys(d, set()) for d in SHARED])
    | {
        "fp16",
        "bf16",
        "loss_scale",
        "optimizer",
        "scheduler",
        "zero_optimization",
        "stage",
        "block_pattern",
        "excluded_modules",
        "sparse_pruning",
        "method",
        "snip_momentum",
        "granularity",
        "group_size",
        "numerics",
        "progressive_layer_drop",
        "comm_timeout_s",
        "tensorboard",
    }
)

SETTINGS = dict(
    database=None,
    deadline=None,
    derandomize=False,
    phases=[Phase.generate, Phase.shrink],
    suppress_health_check=list(HealthCheck),
    print_blob=True,
)

# --- values --------------------------------------------------------------------------------------

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 70),
    st.integers(),
    st.sampled_from([2**64, -(2**80), 10**400]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([math.nan, math.inf, -math.inf, 1e308, -0.0]),
    st.text(max_size=12),
    st.sampled_from(KNOWN),
    st.sampled_from(["all", "*", "(", "a{1,99999999999}", "(" * 1200 + ")" * 1200, "4x1", "2:4", ""]),
    st.binary(max_size=6),
    st.just(datetime.date(2024, 1, 2)),
    st.just(frozenset({1, 2})),
    st.just({1, 2}),
)
odd_keys = st.one_of(
    st.integers(-2, 2),
    st.booleans(),
    st.none(),
    st.floats(allow_nan=True),
    st.tuples(st.integers(), st.text(max_size=3)),
    st.just(frozenset({"a"})),
    st.binary(max_size=3),
)
keys = st.one_of(st.sampled_from(KNOWN), st.text(max_size=10), odd_keys)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.tuples(inner, inner), st.dictionaries(keys, inner, max_size=4)
    ),
    max_leaves=12,
)


# --- the property ----------------------------------------------------------------------------------


def _alarm(signum, frame):
    raise TimeoutError(f"load_config took more than {SECONDS_PER_DOCUMENT} s")


def fingerprint(root):
    """A canonical, comparable encoding of a document, sharing and cycles included (iterative:
    documents may be thousands of levels deep; NaN equals NaN, -0.0 differs from 0.0)."""
    index, nodes, todo = {}, [], []

    def ref(x):
        if isinstance(x, (dict, list, tuple, set, frozenset)):
            if id(x) not in index:
                index[id(x)] = len(nodes)
                nodes.append(None)
                todo.append(x)
            return ("ref", index[id(x)])
        return (type(x).__name__, repr(x))

    top = ref(root)
    while todo:
        x = todo.pop()
        if isinstance(x, dict):
            body = [(ref(k), ref(v)) for k, v in x.items()]
        elif isinstance(x, (set, frozenset)):
            body = sorted(repr(v) for v in x)
        else:
            body = [ref(v) for v in x]
        nodes[index[id(x)]] = (type(x).__name__, body)
    return top, nodes


def outcome(source):
    """Load `source`; anything but a Config or a ConfigError fails the test."""
    before = fingerprint(source) if isinstance(source, dict) else None
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(SECONDS_PER_DOCUMENT)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                if isinstance(source, _Parsed):
                    result = qcompress.load_config(source.parse(source.text, source.name))
                else:
                    result = qcompress.load_config(source)
            except ConfigError as err:
                assert str(err), "a ConfigError must say what is wrong"
                result = err
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    if before is not None:
        assert fingerprint(source) == before, "load_config mutated its input"
    if isinstance(result, Config):
        assert isinstance(result.raw, dict)
    return result


class Doc:
    """A generated document with a bounded repr (deep or cyclic ones would break reporting)."""

    def __init__(self, value, ops=()):
        self.value = value
        self.ops = ops

    def __repr__(self):
        import reprlib

        r = reprlib.Repr()
        r.maxlevel, r.maxdict, r.maxlist, r.maxstring, r.maxother = 6, 8, 6, 60, 60
        try:
            return f"Doc({r.repr(self.value)})"
        except RecursionError:
            return "Doc(<too deep to show>)"


class Counter:
    def __init__(self):
        self.n = self.ok = 0

    def add(self, result):
        self.n += 1
        self.ok += isinstance(result, Config)


# --- 1: mutations of the shared configs -----------------------------------------------------------


def _spots(doc):
    """(container, key) for every value in doc (iteratively), the top level included."""
    out, stack = [], [doc]
    seen = set()
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for k, v in list(items):
            out.append((node, k))
            if isinstance(v, (dict, list)):
                stack.append(v)
    return out


def _nest(value, depth, as_list):
    for _ in range(depth):
        value = [value] if as_list else {"k": value}
    return value


def _laughs(width, levels):
    node = ["lol"] * width
    for _ in range(levels):
        node = [node] * width
    return node


OPS = [
    "value",
    "value",
    "value",
    "delete",
    "add",
    "add",
    "typo",
    "typo",
    "nest",
    "nonfinite",
    "self",
    "odd_key",
    "odd_key",
    "laughs",
]
# one mutation: (operation, which spot, value, key, nesting depth, flag, small number)
mutation = st.tuples(
    st.sampled_from(OPS),
    st.integers(0, 10**6),
    values,
    keys,
    st.sampled_from([1, 3, 49, 50, 51, 200, 3000]),
    st.booleans(),
    st.integers(0, 12),
)
programs = st.lists(mutation, min_size=1, max_size=4)


def apply(program, base):
    """Apply a mutation program to a copy of `base`: Doc(document, operations applied). One
    program is applied to every shared config, so one drawn example tests six documents."""
    doc = copy.deepcopy(base)
    ops = []
    for op, where, value, key, depth, flag, n in program:
        spots = _spots(doc)
        if not spots:
            break
        parent, k = spots[where % len(spots)]
        cur = parent[k]
        value = copy.deepcopy(value)
        ops.append(op)
        if op == "value":
            parent[k] = value
        elif op == "delete":
            del parent[k]
        elif op in ("add", "odd_key") and isinstance(cur, dict):
            cur[key if op == "add" or not isinstance(key, str) else (key,)] = value
        elif op == "typo" and isinstance(parent, dict) and isinstance(k, str) and k:
            i = n % len(k)
            parent[k[:i] + k[i + 1 :] + ("", "s", "_", "X")[n % 4]] = parent.pop(k)
        elif op == "nest":
            parent[k] = _nest(cur, depth, flag)
        elif op == "nonfinite":
            parent[k] = (math.nan, math.inf, -math.inf)[n % 3]
        elif op == "self":
            parent[k] = parent if flag else doc
        elif op == "laughs":
            parent[k] = _laughs(2 + n % 9, 1 + n)
    return Doc(doc, tuple(ops))


def test_fuzz_mutations_of_the_shared_configs():
    count = Counter()

    @seed(20260511)
    @settings(max_examples=1000, **SETTINGS)
    @given(programs)
    def run(program):
        for base in SHARED:
            count.add(outcome(apply(program, base).value))

    run()
    assert count.n >= 6000
    assert 0 < count.ok < count.n  # both outcomes are reached


def test_fuzz_merged_sources():
    count = Counter()

    @seed(7)
    @settings(max_examples=300, **SETTINGS)
    @given(programs, programs)
    def run(pa, pb):
        for i, base in enumerate(SHARED):
            a, b = apply(pa, base).value, apply(pb, SHARED[(i + 1) % 6]).value
            before = fingerprint(a), fingerprint(b)
            old = signal.signal(signal.SIGALRM, _alarm)
            signal.alarm(SECONDS_PER_DOCUMENT)
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    try:
                        result = qcompress.load_config(a, b)
                    except ConfigError as err:
                        result = err
            finally:
                signal.alarm(0)
                signal.signal(signal.SIGALRM, old)
            assert (fingerprint(a), fingerprint(b)) == before, "load_config mutated its input"
            count.add(result)

    run()
    assert count.n >= 1800


# --- 2: YAML and JSON text ------------------------------------------------------------------------

YAML_SNIPPETS = [
    "a: &R [*R]\n",
    "a: &R {b: *R}\n",
    "? [1, 2]\n: x\n",
    "? {a: 1}\n: x\n",
    "? !!set {a, b}\n: 1\n",
    "x: !!python/object/apply:os.system ['true']\n",
    "x: !custom 1\n",
    "x: !!binary aGVsbG8=\n",
    "x: !!timestamp 2001-12-14\n",
    "x: !!float .nan\n",
    "x: !!float\n",
    "x: !!int\n",
    "x: !!timestamp x\n",
    "x: !!bool maybe\n",
    "x: !!binary '%%%'\n",
    "x: !!null 1\n",
    "x: !!omap [1]\n",
    "x: !!pairs {a: 1}\n",
    "fp16: {enabled: true, loss_scale: .inf}\n",
    "x: !!set {a, b}\n",
    "1: x\n",
    "true: x\n",
    "null: x\n",
    "[1, 2]\n",
    "'just a string'\n",
    "\t x: 1\n",
    "a: 1\na: 2\n",
    "<<: {train_batch_size: 4}\n",
    "x: *undefined\n",
    "%YAML 1.1\n---\na: 1\n",
    "a: 1\n---\nb: 2\n",
    "x: 0x10\n",
    "x: 1_000\n",
    "x: 0o17\n",
    "x: 1e400\n",
    "x: 123456789" * 500 + "\n",
    "steps_per_print: " + "[" * 5000 + "]" * 5000 + "\n",
    "x: " + "{a: " * 2000 + "1" + "}" * 2000 + "\n",
]
LAUGHS = (
    "a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n"
    + "".join(f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 9)}]\n" for i in range(8))
    + "steps_per_print: *i\n"
)


TEXT_OPS = st.lists(
    st.tuples(
        st.sampled_from(["snippet", "snippet", "truncate", "insert", "laughs", "nan"]),
        st.integers(0, 10**6),
        st.sampled_from(YAML_SNIPPETS),
        st.booleans(),
        st.text(max_size=5)
        | st.sampled_from(["&x ", "*x", "!!str ", ": ", "\n- ", "{", "]", "\t", "? ", "NaN", "Infinity", "\x00"]),
    ),
    max_size=3,
)


def to_text(drawn, kind, flow, text_ops):
    """The document as YAML or JSON text, then text-level damage."""
    doc = drawn.value
    if kind == "json" and "laughs" in drawn.ops:  # JSON would write every shared copy out
        doc = SHARED[2]
    try:
        text = yaml.dump(doc, Dumper=_DUMPER, default_flow_style=flow) if kind == "yaml" else json.dumps(doc)
    except (ValueError, TypeError, yaml.YAMLError, RecursionError):
        text = json.dumps(SHARED[0])
    for op, where, snippet, flag, chars in text_ops:
        if op == "snippet":
            text = text + "\n" + snippet if flag else snippet
        elif op == "truncate":
            text = text[: where % (len(text) + 1)]
        elif op == "insert":
            i = where % (len(text) + 1)
            text = text[:i] + chars + text[i:]
        elif op == "laughs":
            text = LAUGHS
        elif op == "nan" and kind == "json":
            text = (
                text.replace("0.", 'NaN, "x": 0.', 1)
                if flag
                else '{"fp16": {"enabled": true, "loss_scale": Infinity}, "gradient_clipping": NaN}'
            )
    return text


def test_fuzz_yaml_and_json_text():
    # parse_document is read_document after reading the file (which the snippet test below and
    # test_config.py exercise); no file per document keeps the run within CI time
    from qcompress.config.loader import parse_document

    count = Counter()

    @seed(1105)
    @settings(max_examples=600, **SETTINGS)
    @given(programs, st.integers(0, 5), st.booleans(), TEXT_OPS)
    def run(program, which, flow, text_ops):
        for base in (SHARED[which], SHARED[(which + 3) % 6]):
            drawn = apply(program, base)
            for kind in ("yaml", "json"):
                text = to_text(drawn, kind, flow, text_ops)
                count.add(outcome(_Parsed(parse_document, text, f"cfg.{kind}")))

    run()
    assert count.n >= 2400


class _Parsed:
    """A text source for outcome(): parse it, then load the dict, as load_config(path) does."""

    def __init__(self, parse, text, name):
        self.parse, self.text, self.name = parse, text, name


def test_every_yaml_snippet_gives_config_or_config_error(tmp_path):
    # the snippets alone (the fuzzer draws them at random), each an issue-11 case
    for i, text in enumerate(YAML_SNIPPETS + [LAUGHS]):
        path = tmp_path / f"s{i}.yaml"
        path.write_text(text)
        outcome(str(path))
    for name, data in (
        ("bad.yaml", b"a: \xff\xfe\n"),
        ("bad.json", b'{"a": "\xff"}'),
        ("nan.json", b'{"gradient_clipping": NaN}'),
        ("deep.json", b"[" * 100000),
    ):
        (tmp_path / name).write_bytes(data)
        assert isinstance(outcome(str(tmp_path / name)), ConfigError), name


# --- 3: random trees of known and unknown keys ------------------------------------------------------

sections = st.fixed_dictionaries(
    {},
    optional={
        k: values
        for k in (
            "train_batch_size",
            "fp16",
            "bf16",
            "optimizer",
            "scheduler",
            "zero_optimization",
            "gradient_clipping",
            "compression_training",
            "progressive_layer_drop",
            "comm_timeout_s",
            "steps_per_print",
            "wandb",
        )
    },
)


@st.composite
def random_trees(draw):
    doc = draw(sections)
    if draw(st.booleans()):
        tech = draw(
            st.sampled_from(
                [
                    "weight_quantization",
                    "activation_quantization",
                    "sparse_pruning",
                    "row_pruning",
                    "head_pruning",
                    "channel_pruning",
                    "layer_reduction",
                ]
            )
        )
        shared = draw(st.dictionaries(st.sampled_from(KNOWN), values, max_size=5))
        shared.setdefault("enabled", draw(st.booleans()))
        groups = draw(
            st.dictionaries(
                st.text(max_size=4) | st.sampled_from(KNOWN),
                st.fixed_dictionaries(
                    {"params": st.dictionaries(st.sampled_from(KNOWN), values, max_size=4)},
                    optional={"modules": values},
                ),
                max_size=2,
            )
        )
        doc["compression_training"] = {tech: {"shared_parameters": shared, "different_groups": groups}}
    return Doc(doc)


def test_fuzz_random_trees():
    count = Counter()

    @seed(404)
    @settings(max_examples=500, **SETTINGS)
    @given(random_trees())
    def run(doc):
        count.add(outcome(doc.value))

    run()
    assert count.n >= 500


# --- inputs that once escaped as other exceptions -------------------------------------------------


@pytest.mark.parametrize(
    "doc,path",
    [
        ({"compression_training": {"weight_quantization": {1: {}}}}, "compression_training.weight_quantization"),
        ({"fp16": {"enabled": True, "loss_scale": math.inf}}, "fp16.loss_scale"),
        ({"gradient_clipping": math.nan}, "gradient_clipping"),
        ({"steps_per_print": _nest(1, 3000, True)}, "steps_per_print"),
        ({"train_batch_size": 10**400, "gradient_clipping": 10**400}, "gradient_clipping"),
    ],
)
def test_reported_cases(doc, path):
    with pytest.raises(ConfigError) as err:
        qcompress.load_config(doc)
    assert err.value.path.startswith(path), (err.value.path, str(err.value))


def test_recursive_and_exponential_yaml_aliases_fail_at_load(tmp_path):
    rec = tmp_path / "rec.yaml"
    rec.write_text("steps_per_print: &R [*R]\n")
    with pytest.raises(ConfigError, match=r"steps_per_print(\[0\])*: contains itself.*recursive YAML alias"):
        qcompress.load_config(str(rec))
    laughs = tmp_path / "laughs.yaml"
    laughs.write_text(LAUGHS)
    with pytest.raises(ConfigError, match="expands to more than 20000 values"):
        qcompress.load_config(str(laughs))
    # a modest alias (shared defaults) is fine
    ok = tmp_path / "ok.yaml"
    ok.write_text("optimizer: &o {type: Adam, params: {lr: 0.001}}\nwandb: {x: *o}\n")
    assert qcompress.load_config(str(ok)).optimizer.type == "Adam"
