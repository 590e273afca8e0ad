"""Unit tests of models/: shapes, the layer-sequence contract, seeded init, loss, gradients."""

import math
from pathlib import Path

import pytest
import torch

from models import (
    BERT, GPT, Block, build_block, build_model, model_flops_per_token, parameter_count,
)

TINY = dict(sequence_length=32, layers=2, hidden=64, heads=4)
TINY_VOCAB = {"gpt": 256, "bert": 257}  # BERT's vocabulary has one extra [MASK] id
ARCHITECTURES = ["gpt", "bert"]


def tiny(architecture, **overrides):
    return build_model(architecture, **{"vocab_size": TINY_VOCAB[architecture], **TINY,
                                        **overrides})


def random_tokens(vocab_size, batch=2, length=32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch, length), generator=generator)


def manual_forward(model, tokens):
    x = model.embed(tokens)
    for index in range(len(model.blocks)):
        x = model.blocks[str(index)](x)
    return model.head(x)


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_tiny_forward_shape_and_layer_sequence(architecture):
    model = tiny(architecture).eval()
    tokens = random_tokens(TINY_VOCAB[architecture])
    logits = model(tokens)
    assert logits.shape == (2, 32, TINY_VOCAB[architecture])
    assert list(model.blocks.keys()) == ["0", "1"]
    assert all(isinstance(block, Block) for block in model.blocks.values())
    torch.testing.assert_close(logits, manual_forward(model, tokens), rtol=0, atol=0)


@pytest.mark.parametrize("architecture, shape, length", [
    ("gpt", dict(layers=6, hidden=384, heads=6, sequence_length=256), 256),  # gpt_small
    ("bert", dict(layers=12, hidden=768, heads=12, sequence_length=128), 128),  # bert_base
])
def test_named_shapes_run(architecture, shape, length):
    model = build_model(architecture, vocab_size=257, **shape).eval()
    with torch.no_grad():
        logits = model(random_tokens(257, batch=1, length=length))
    assert logits.shape == (1, length, 257)
    assert torch.isfinite(logits).all()


def test_block_names_that_strategies_rely_on():
    names = {name for name, _ in tiny("gpt").blocks["0"].named_modules()}
    for name in ["attention.qkv", "attention.proj", "mlp.fc_in", "mlp.fc_out",
                 "norm_attention", "norm_mlp"]:
        assert name in names
    block = tiny("gpt").blocks["0"]
    assert isinstance(block.attention.qkv, torch.nn.Linear)
    assert block.attention.qkv.weight.shape == (3 * 64, 64)


def test_gpt_is_causal_and_bert_is_not():
    tokens = random_tokens(256, batch=1)
    changed = tokens.clone()
    changed[0, -1] = (changed[0, -1] + 1) % 256  # only the last token differs
    for architecture, causal in [("gpt", True), ("bert", False)]:
        model = tiny(architecture).eval()
        before, after = model(tokens), model(changed)
        assert torch.equal(before[0, :-1], after[0, :-1]) == causal


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_same_seed_same_weights_different_seed_different(architecture):
    torch.manual_seed(1)
    first = tiny(architecture, seed=7).state_dict()
    torch.manual_seed(2)  # the global RNG must not matter
    second = tiny(architecture, seed=7).state_dict()
    other = tiny(architecture, seed=8).state_dict()
    assert first.keys() == second.keys()
    for name in first:
        assert torch.equal(first[name], second[name]), name
    assert not torch.equal(first["blocks.0.attention.qkv.weight"],
                           other["blocks.0.attention.qkv.weight"])
    assert not torch.equal(first["embed.token.weight"], other["embed.token.weight"])


def test_construction_leaves_the_global_rng_alone():
    torch.manual_seed(3)
    expected = torch.rand(4)
    torch.manual_seed(3)
    tiny("gpt")
    assert torch.equal(torch.rand(4), expected)


def test_init_does_not_depend_on_default_dtype():
    reference = tiny("gpt", seed=5).state_dict()
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        double = tiny("gpt", seed=5).state_dict()
    finally:
        torch.set_default_dtype(previous)
    for name in reference:
        assert double[name].dtype == torch.float64
        assert torch.equal(double[name].float(), reference[name]), name


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_block_built_alone_equals_the_full_models_block(architecture):
    layers = 4
    model = tiny(architecture, layers=layers, seed=11)
    alone = build_block(hidden=64, heads=4, mlp_ratio=4, dropout=0.0,
                        causal=architecture == "gpt", seed=11, index=2, layers=layers)
    expected = model.blocks["2"].state_dict()
    for name, value in alone.state_dict().items():
        assert torch.equal(value, expected[name]), name


def test_blocks_differ_from_each_other_and_residual_projections_are_scaled():
    model = tiny("gpt", layers=8)
    assert not torch.equal(model.blocks["0"].mlp.fc_in.weight, model.blocks["1"].mlp.fc_in.weight)
    qkv_std = model.blocks["0"].attention.qkv.weight.std().item()
    proj_std = model.blocks["0"].attention.proj.weight.std().item()
    assert qkv_std == pytest.approx(0.02, rel=0.1)
    assert proj_std == pytest.approx(0.02 / math.sqrt(2 * 8), rel=0.1)
    assert torch.all(model.blocks["0"].attention.qkv.bias == 0)
    assert torch.all(model.blocks["0"].norm_mlp.weight == 1)


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_tied_embeddings_share_one_parameter(architecture):
    model = tiny(architecture, tie_embeddings=True)
    assert model.head.output.weight is model.embed.token.weight
    untied = tiny(architecture)
    assert parameter_count(untied) - parameter_count(model) == TINY_VOCAB[architecture] * 64


def test_initial_gpt_loss_is_uniform_over_bytes():
    model = tiny("gpt")
    tokens = random_tokens(256, batch=4, length=33)
    with torch.no_grad():
        loss = model.loss(model(tokens[:, :-1]), tokens[:, 1:])
    assert abs(loss.item() - math.log(256)) < 0.15


def test_loss_ignores_minus_100_targets():
    model = tiny("bert")
    tokens = random_tokens(257)
    targets = torch.full_like(tokens, -100)
    targets[:, 3] = tokens[:, 3]
    logits = model(tokens)
    expected = torch.nn.functional.cross_entropy(logits[:, 3], tokens[:, 3])
    torch.testing.assert_close(model.loss(logits, targets), expected)


@pytest.mark.parametrize("architecture", ARCHITECTURES)
@pytest.mark.parametrize("tie_embeddings", [False, True])
def test_gradient_reaches_every_parameter(architecture, tie_embeddings):
    model = tiny(architecture, dropout=0.1, tie_embeddings=tie_embeddings)
    tokens = random_tokens(TINY_VOCAB[architecture])
    model.loss(model(tokens), tokens).backward()
    for name, parameter in model.named_parameters():
        assert parameter.grad is not None, name
        assert parameter.grad.abs().sum() > 0, name


def test_dropout_is_modules_only():
    model = tiny("gpt", dropout=0.1)
    dropouts = [m for m in model.modules() if isinstance(m, torch.nn.Dropout)]
    assert len(dropouts) == 1 + 2 * 2  # embedding, and attention + MLP output in each block
    assert all(m.p == 0.1 for m in dropouts)


def test_sequence_longer_than_positions_names_the_fields():
    with pytest.raises(ValueError, match="data.sequence_length"):
        tiny("gpt")(random_tokens(256, length=33))


def test_build_model_rejects_unknown_architecture_and_bad_heads():
    with pytest.raises(ValueError, match="model.architecture"):
        build_model("t5", **TINY, vocab_size=256)
    with pytest.raises(ValueError, match="model.heads"):
        build_model("gpt", vocab_size=256, sequence_length=8, layers=1, hidden=64, heads=5)
    assert isinstance(build_model("gpt", **TINY, vocab_size=256), GPT)
    assert isinstance(build_model("bert", **TINY, vocab_size=256), BERT)


def test_model_flops_per_token():
    # GPT-3 175B (Brown et al. 2020): 96 layers, 12288 wide, 2048 tokens -> about 6·175e9 per token
    flops = model_flops_per_token(96, 12288, 2048, 50257)
    assert flops == pytest.approx(6 * 175e9, rel=0.05)
    small = model_flops_per_token(2, 64, 32, 256)
    assert small == 6 * (2 * 12 * 64**2 + 64 * 256) + 12 * 2 * 64 * 32


def test_models_never_mention_the_distributed_package():
    forbidden = "torch." + "distributed"  # split so this test file does not match itself
    models_directory = Path(__file__).resolve().parents[1] / "models"
    files = sorted(models_directory.rglob("*.py"))
    assert files
    offenders = [str(f) for f in files if forbidden in f.read_text()]
    assert offenders == []


# ----- floors, no circles (docs/architecture.md "Floors"): read from every file's syntax tree

REPOSITORY = Path(__file__).resolve().parents[1]
FLOORS = ("models", "parallel", "strategies", "cost", "layerwise")  # each imports only those before it
# Inside layerwise/: each room imports only the rooms before it; the modules at layerwise/'s top
# (preflight, the `python -m` entry points) stand above every room.
ROOMS = ("config", "planning", "run", "tools", "cluster", "reproduce")
LIBRARY = FLOORS + ("hydra_plugins",)
SCRIPTS = ("tests", "benchmarks", "scripts")  # may edit sys.path; the library may not import them


def module_files(root: Path, tops=LIBRARY + SCRIPTS) -> dict:
    """module name -> file, for every .py under the given top-level folders (and train.py)."""
    found = {"train": root / "train.py"} if (root / "train.py").exists() else {}
    for top in tops:
        for path in sorted((root / top).rglob("*.py")) if (root / top).is_dir() else []:
            parts = list(path.relative_to(root).with_suffix("").parts)
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def import_graph(root: Path, tops=LIBRARY + SCRIPTS) -> dict:
    """module -> the repository's modules it imports anywhere in its file (inside functions and
    `if TYPE_CHECKING:` too: a lazy import is still an arrow), `from a import b` naming module a.b
    when that is a module, relative imports resolved."""
    import ast
    files = module_files(root, tops)

    def resolve(name: str):
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for module, path in files.items():
        package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = ".".join(package[:len(package) - node.level + 1] + [node.module or ""]).strip(".") \
                    if node.level else node.module
                targets.add(base)
                targets.update(f"{base}.{alias.name}" for alias in node.names)
        graph[module] = {resolve(t) for t in targets} - {None, module}
    return graph


def cycles(graph: dict) -> list:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], [0]
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = counter[0]; counter[0] += 1
        stack.append(start); on_stack.add(start)
        while work:
            node, successors = work[-1]
            for successor in successors:
                if successor not in index:
                    index[successor] = low[successor] = counter[0]; counter[0] += 1
                    stack.append(successor); on_stack.add(successor)
                    work.append((successor, iter(sorted(graph.get(successor, ())))))
                    break
                if successor in on_stack:
                    low[node] = min(low[node], index[successor])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop(); on_stack.discard(member); component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def level(module: str) -> tuple:
    """(floor, room) of a library module: a higher tuple may import a lower or equal one only."""
    parts = module.split(".")
    floor = FLOORS.index(parts[0])
    if parts[0] != "layerwise" or len(parts) == 1:
        return floor, -1 if parts[0] == "layerwise" else 0  # layerwise/__init__: imports nothing
    return floor, ROOMS.index(parts[1]) if parts[1] in ROOMS else len(ROOMS)


def upward_imports(graph: dict) -> list:
    return sorted(f"{source} -> {target}" for source, targets in graph.items() for target in targets
                  if source.split(".")[0] in FLOORS and target.split(".")[0] in FLOORS
                  and level(target) > level(source))


def test_floors_and_rooms_import_only_downwards():
    """models < parallel < strategies < cost < layerwise, and inside layerwise/ config < planning <
    run < tools < cluster < reproduce < its top (preflight, entry points): no arrow runs up."""
    graph = import_graph(REPOSITORY)
    assert {module.split(".")[0] for module in graph} >= set(FLOORS)
    rooms = {module.split(".")[1] for module in graph if module.startswith("layerwise.") and module.count(".") >= 2}
    assert rooms <= set(ROOMS), f"a new room of layerwise/ needs its place in ROOMS: {rooms - set(ROOMS)}"
    assert upward_imports(graph) == []


def test_no_import_cycles_anywhere():
    """No circle of imports, inside a floor either, counting imports inside functions (tests,
    benchmarks and scripts included)."""
    assert cycles(import_graph(REPOSITORY)) == []


def test_library_never_imports_tests_or_benchmarks_nor_edits_sys_path():
    import ast
    graph = import_graph(REPOSITORY)
    library = {module for module in graph if module.split(".")[0] in LIBRARY}
    assert sorted(f"{source} -> {target}" for source in library for target in graph[source]
                  if target.split(".")[0] in SCRIPTS) == []
    edits = [str(path) for module, path in module_files(REPOSITORY).items() if module in library
             for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.Attribute) and node.attr == "path"
             and isinstance(node.value, ast.Name) and node.value.id == "sys"]
    assert edits == []
    # A bare `import pipefisher_packing` works only where a script put benchmarks/ on sys.path: the
    # graph above cannot see it as the repository's, so name the scripts' own modules here.
    script_names = {path.stem for top in SCRIPTS for path in (REPOSITORY / top).glob("*.py")} - set(LIBRARY)
    bare = sorted(f"{module} -> {name}" for module, path in module_files(REPOSITORY).items() if module in library
                  for node in ast.walk(ast.parse(path.read_text()))
                  for name in ([alias.name for alias in node.names] if isinstance(node, ast.Import) else
                               [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
                  if name.split(".")[0] in script_names)
    assert bare == []


def test_benchmarks_import_the_library_never_tests():
    """A benchmark is a command line over the library (benchmarks/common.py composes and forks ranks
    with the library's own pieces): it never imports tests/, whose helpers serve the tests only."""
    assert benchmark_imports_of_tests(import_graph(REPOSITORY)) == []


def benchmark_imports_of_tests(graph: dict) -> list:
    return sorted(f"{source} -> {target}" for source, targets in graph.items() if source.split(".")[0] == "benchmarks"
                  for target in targets if target.split(".")[0] == "tests")


def test_the_floor_checks_catch_a_planted_cycle_and_an_upward_import(tmp_path):
    """The checks above, on a planted tree: a lazy import closing a circle, a cost module importing
    the run, a room importing a later room, a benchmark importing tests/ lazily."""
    for name, text in {"cost/__init__.py": "", "cost/a.py": "def f():\n    from cost import b\n",
                       "cost/b.py": "from cost.a import f\nimport layerwise.run.fit\n",
                       "layerwise/__init__.py": "", "layerwise/run/__init__.py": "",
                       "layerwise/run/fit.py": "from layerwise.tools.x import y\n",
                       "layerwise/tools/__init__.py": "", "layerwise/tools/x.py": "y = 1\n",
                       "tests/__init__.py": "", "tests/ranks.py": "z = 1\n",
                       "benchmarks/b.py": "def g():\n    from tests.ranks import z\n"}.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    graph = import_graph(tmp_path)
    assert cycles(graph) == [["cost.a", "cost.b"]]
    assert upward_imports(graph) == ["cost.b -> layerwise.run.fit", "layerwise.run.fit -> layerwise.tools.x"]
    assert benchmark_imports_of_tests(graph) == ["benchmarks.b -> tests.ranks"]
