"""Glyph images for the `glyphs` workload: 128 letter classes rendered from bundled fonts.

Offline, from the TrueType files matplotlib ships (`mpl-data/fonts/ttf`), never the system's,
whose set differs from one host to the next. 16 of them cover Latin, Greek and Cyrillic:
DejaVu Sans, Sans Mono, Serif and STIX General, each regular, bold, italic/oblique and bold
italic/oblique. The rendering is the same wherever the fonts are; the augmented arrays are
deterministic on one machine, but their last bits follow its torch kernels (`affine_grid`'s
matmul and `randn` give other bits under another kernel dispatch, and an AVX-512 machine built
other arrays than the AVX2 machines before it), so the data fingerprint a profile records can
differ between machines.

Classes (`CLASSES`): Latin capitals and the lowercase letters whose shape differs from their
capital's (c, o, s, u, v, w, x, z and l are left out: a scaled lowercase o *is* an O), the
digits 2-9 (0 and 1 are O and I), the Greek capitals and lowercase letters that are not Latin
look-alikes, the Cyrillic capitals that look like no Latin or Greek letter nor a digit, and
25 symbols: 128 classes in all. (A test renders every class in every font and requires ink and
128 distinct images per font.)

Split by font, so the test set measures generalisation to typefaces never seen in training:
the four `TEST_FONTS` (one style of each family) are held out; the other twelve train.

Each glyph is rendered once per font at 4x resolution (baseline fixed, so size and vertical
position carry information as on a text line), in three stroke weights (as drawn, dilated,
eroded), then every sample is an augmented copy: a random weight, a random affine (rotation,
scale, shear, shift) sampled at 2x, an area downsample to `SIZE` px, and pixel noise. Everything is drawn from
a fixed-seed generator, so the arrays, and their fingerprint, are deterministic. The build
takes a few seconds; the result is cached on disk (`nfabric_cli/cache.py`) under a key of the
fonts' bytes and the build parameters, and in memory.
"""

from __future__ import annotations

import functools
import hashlib
import io
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from nfabric_cli.atomic import atomic_path
from nfabric_cli.cache import cache_dir
from nfabric_cli.errors import InputError
from nfabric_cli.workloads.images import ImageData

SIZE = 24  # training image side, px
SCALE = 4  # render at SCALE x SIZE, then downsample: smooth antialiased strokes
TRAIN_COPIES = 8  # augmented samples per (class, training font)
TEST_COPIES = 2  # per (class, held-out font), drawn with the training copies (version 1's test set)
EXTRA_TEST_COPIES = 6  # more per (class, held-out font), from a second generator: 4,096 in all
BUILD_SEED = 20261201
VERSION = 2  # bump when the build changes: it is part of the cache key and fingerprint

_LATIN_UPPER = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
_LATIN_LOWER = "abdefghijkmnpqrty"  # not c o s u v w x z l: scaled capitals or I
_DIGITS = "23456789"
_GREEK_UPPER = "ΓΔΘΛΞΠΣΦΨΩ"  # the rest are Latin capitals
_GREEK_LOWER = "αβγδεζηθικλμνξπρστφχψω"  # not ο (o) nor υ (u-like)
_CYRILLIC_UPPER = "БДЖИЙЛЦЧШЩЪЫЬЭЮЯ"  # not Г П Ф (Greek), З (3), nor the Latin look-alikes
_SYMBOLS = "#$%&@?!+=<>{}[]()/\\*~^§¶£¥€©±"
CLASSES = (
    _LATIN_UPPER + _LATIN_LOWER + _DIGITS + _GREEK_UPPER + _GREEK_LOWER + _CYRILLIC_UPPER
    + _SYMBOLS
)

FONTS = (
    "DejaVuSans.ttf", "DejaVuSans-Bold.ttf", "DejaVuSans-Oblique.ttf",
    "DejaVuSans-BoldOblique.ttf", "DejaVuSansMono.ttf", "DejaVuSansMono-Bold.ttf",
    "DejaVuSansMono-Oblique.ttf", "DejaVuSansMono-BoldOblique.ttf", "DejaVuSerif.ttf",
    "DejaVuSerif-Bold.ttf", "DejaVuSerif-Italic.ttf", "DejaVuSerif-BoldItalic.ttf",
    "STIXGeneral.ttf", "STIXGeneralBol.ttf", "STIXGeneralItalic.ttf", "STIXGeneralBolIta.ttf",
)
TEST_FONTS = (
    "DejaVuSans-BoldOblique.ttf", "DejaVuSansMono-Oblique.ttf", "DejaVuSerif-Bold.ttf",
    "STIXGeneral.ttf",
)


def font_dir() -> Path:
    """matplotlib's bundled TrueType fonts."""
    import matplotlib

    return Path(matplotlib.__file__).resolve().parent / "mpl-data" / "fonts" / "ttf"


def _render_font(path: Path) -> np.ndarray:
    """Every class of one font at SCALE x SIZE px, (len(CLASSES), S, S) uint8, baseline fixed."""
    from PIL import Image, ImageDraw, ImageFont

    side = SIZE * SCALE
    font = ImageFont.truetype(str(path), size=int(round(0.72 * side)))
    out = np.zeros((len(CLASSES), side, side), dtype=np.uint8)
    for i, char in enumerate(CLASSES):
        image = Image.new("L", (side, side), 0)
        # "ms": horizontally centred on its advance, vertically on the baseline at 76 %.
        ImageDraw.Draw(image).text((side / 2, 0.76 * side), char, fill=255, font=font,
                                   anchor="ms")
        out[i] = np.asarray(image)
    return out


def _stroke_weights(glyphs: torch.Tensor) -> torch.Tensor:
    """(3, N, 1, S, S): the glyphs as rendered, dilated (bolder) and eroded (lighter)."""
    x = glyphs.unsqueeze(1)
    dilated = F.max_pool2d(x, 5, stride=1, padding=2)
    eroded = -F.max_pool2d(-x, 3, stride=1, padding=1)
    return torch.stack([x, dilated, eroded])


def _augment(weights: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """One augmented (N, 1, SIZE, SIZE) image in [0, 1] per glyph of `weights` (3, N, 1, S, S):
    a random stroke weight, a random affine, an area downsample, pixel noise."""
    n = weights.shape[1]
    pick = torch.randint(0, 3, (n,), generator=gen)
    x = weights[pick, torch.arange(n)]

    def uniform(lo: float, hi: float) -> torch.Tensor:
        return lo + (hi - lo) * torch.rand(n, generator=gen, dtype=torch.float64)

    angle = uniform(-0.2, 0.2)  # radians, about +-11 degrees
    scale = uniform(0.85, 1.15)
    shear = uniform(-0.15, 0.15)
    shift = torch.stack([uniform(-0.12, 0.12), uniform(-0.12, 0.12)], dim=1)
    cos, sin = torch.cos(angle) / scale, torch.sin(angle) / scale
    theta = torch.zeros(n, 2, 3, dtype=torch.float64)
    theta[:, 0, 0], theta[:, 0, 1] = cos, -sin + shear
    theta[:, 1, 0], theta[:, 1, 1] = sin, cos
    theta[:, :, 2] = shift
    # sample at 2 x SIZE, then average 2 x 2: antialiased without sampling the full render
    grid = F.affine_grid(theta.float(), [n, 1, 2 * SIZE, 2 * SIZE], align_corners=False)
    x = F.grid_sample(x, grid, mode="bilinear", padding_mode="zeros", align_corners=False)
    x = F.avg_pool2d(x, 2)
    x = x + 0.08 * torch.randn(x.shape, generator=gen)
    return x.clamp_(0.0, 1.0)


def _build(fonts: dict[str, Path]) -> dict[str, np.ndarray]:
    """Training and test images, uint8, with their labels.

    The extra test copies come from their own generator after everything else, so the
    training images and the first `TEST_COPIES` test copies are version 1's, bit for bit:
    figures measured on version 1 can be re-scored on its 1,024 test images.
    """
    gen = torch.Generator().manual_seed(BUILD_SEED)
    extra = torch.Generator().manual_seed(BUILD_SEED + 1)
    parts: dict[str, list[torch.Tensor]] = {"train": [], "test": []}
    labels: dict[str, list[torch.Tensor]] = {"train": [], "test": []}
    classes = torch.arange(len(CLASSES))
    held_out = []
    for name in FONTS:
        weights = _stroke_weights(torch.from_numpy(_render_font(fonts[name])).float() / 255.0)
        split = "test" if name in TEST_FONTS else "train"
        copies = TEST_COPIES if split == "test" else TRAIN_COPIES
        for _ in range(copies):
            parts[split].append(_augment(weights, gen))
            labels[split].append(classes)
        if split == "test":
            held_out.append(weights)
    for weights in held_out:
        for _ in range(EXTRA_TEST_COPIES):
            parts["test"].append(_augment(weights, extra))
            labels["test"].append(classes)
    out = {}
    for split in ("train", "test"):
        images = torch.cat(parts[split])
        out[f"x_{split}"] = (images.squeeze(1).numpy() * 255.0 + 0.5).astype(np.uint8)
        out[f"y_{split}"] = torch.cat(labels[split]).numpy().astype(np.int64)
    return out


def _key(fonts: dict[str, Path]) -> str:
    digest = hashlib.sha256(f"glyphs v{VERSION} {SIZE} {SCALE} {TRAIN_COPIES} {TEST_COPIES} "
                            f"{EXTRA_TEST_COPIES} "
                            f"{BUILD_SEED} {CLASSES} {TEST_FONTS}".encode())
    for name in FONTS:
        digest.update(fonts[name].read_bytes())
    return digest.hexdigest()


def _load_or_build(fonts: dict[str, Path]) -> dict[str, np.ndarray]:
    path = cache_dir() / f"glyphs-{_key(fonts)[:16]}.npz"
    try:
        with np.load(path) as cached:
            return {k: cached[k] for k in ("x_train", "y_train", "x_test", "y_test")}
    except (OSError, KeyError, ValueError):
        pass  # absent or unreadable: build it
    arrays = _build(fonts)
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    try:
        with atomic_path(path) as tmp:
            tmp.write_bytes(buffer.getvalue())
    except OSError:
        pass  # a read-only home still trains; it just builds again next time
    return arrays


@functools.lru_cache(maxsize=1)
def load_glyphs() -> ImageData:
    """The glyph images, standardised with the training split's mean and std."""
    root = font_dir()
    fonts = {name: root / name for name in FONTS}
    missing = [name for name, p in fonts.items() if not p.is_file()]
    if missing:
        raise InputError(f"workload 'glyphs' needs matplotlib's bundled fonts; {root} lacks "
                         f"{', '.join(missing)}")
    arrays = _load_or_build(fonts)
    digest = hashlib.sha256()
    for k in ("x_train", "y_train", "x_test", "y_test"):
        digest.update(np.ascontiguousarray(arrays[k]).tobytes())
    x_train = arrays["x_train"].astype(np.float32) / 255.0
    mean, std = float(x_train.mean()), float(x_train.std())

    def normalise(images: np.ndarray) -> torch.Tensor:
        return torch.from_numpy((images.astype(np.float32) / 255.0 - mean) / std).unsqueeze(1)

    return ImageData(normalise(arrays["x_train"]), torch.from_numpy(arrays["y_train"]),
                     normalise(arrays["x_test"]), torch.from_numpy(arrays["y_test"]),
                     len(CLASSES), digest.hexdigest(), "glyphs")
