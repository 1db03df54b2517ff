"""Pictures of decoding (issue 40): decoding traces (:mod:`setdiff_mega.decoding.trace`) drawn as a PNG grid,
an animated GIF and a self-contained HTML page; several traces (methods, or one model at several settings)
side by side. Pillow draws and encodes; colours come from matplotlib's ``viridis`` map.

Grid (PNG), per panel: one column per generated position (left to right), one row per decode step (top to
bottom); the token committed at step s in position p is a cell at (row s, column p) coloured by s, with its
text. A left-to-right decoder draws a diagonal; a set decoder a staircase of several cells per row, out of
order inside its window. Geometry (:func:`grid_cells`): cell ``CELL_W x CELL_H`` pixels from ``(MARGIN,
top)``, a ``LABEL_H`` band with the panel's label above each panel.

Animation (GIF, one frame per step; the HTML page animates the same frames in the browser): per panel the
generated positions in rows of ``WRAP`` cells; after step s every committed token is a coloured cell with its
text (the cells of step s outlined), every position still masked a grey cell. In a comparison a panel whose
decode has ended keeps its last frame.
"""
from __future__ import annotations

import html
import json
from dataclasses import asdict
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

CELL_W, CELL_H, MARGIN, LABEL_H, WRAP = 44, 18, 8, 20, 16
MASKED, WHITE, INK = (215, 215, 215), (255, 255, 255), (0, 0, 0)


def step_colour(step: int, steps: int) -> tuple[int, int, int]:
    from matplotlib import colormaps

    r, g, b, _ = colormaps["viridis"](0.1 + 0.8 * step / max(steps - 1, 1))
    return int(r * 255), int(g * 255), int(b * 255)


def _label(text: str, width: int) -> str:
    text = text.replace("\n", "\\n")
    return text if len(text) <= width else text[:width - 1] + "\u2026"


def _text_colour(rgb) -> tuple[int, int, int]:
    return INK if sum(rgb) > 380 else WHITE


def _font():
    return ImageFont.load_default()


def grid_cells(traces: list, top: int = 0) -> list[list[tuple[int, int, int, int]]]:
    """Per panel, per token (in position order): its cell's box (x0, y0, x1, y1) in the grid PNG."""
    out = []
    for t in traces:
        y = top + LABEL_H
        order = sorted(range(len(t.positions)), key=lambda j: t.positions[j])
        col = {j: c for c, j in enumerate(order)}
        out.append([(MARGIN + col[j] * CELL_W, y + t.steps[j] * CELL_H, MARGIN + (col[j] + 1) * CELL_W - 2,
                     y + (t.steps[j] + 1) * CELL_H - 2) for j in range(len(t.tokens))])
        top = y + max(t.num_steps, 1) * CELL_H + MARGIN
    return out


def render_grid(panels: list[tuple[str, object]], path: Path) -> Path:
    """PNG of (label, trace) panels stacked vertically (module docstring)."""
    traces = [t for _, t in panels]
    width = MARGIN * 2 + CELL_W * max(max((len(t.tokens) for t in traces), default=1), 8)
    height = sum(LABEL_H + max(t.num_steps, 1) * CELL_H + MARGIN for t in traces) + MARGIN
    img = Image.new("RGB", (width, height), WHITE)
    draw, font = ImageDraw.Draw(img), _font()
    top = 0
    for (label, t), cells in zip(panels, grid_cells(traces)):
        draw.text((MARGIN, top + 4), _label(f"{label}: {len(t.tokens)} tokens in {t.num_steps} steps", 120),
                  fill=INK, font=font)
        for j, box in enumerate(cells):
            rgb = step_colour(t.steps[j], t.num_steps)
            draw.rectangle(box, fill=rgb)
            draw.text((box[0] + 2, box[1] + 3), _label(_text(t, j), 6), fill=_text_colour(rgb), font=font)
        top += LABEL_H + max(t.num_steps, 1) * CELL_H + MARGIN
    img.save(path, format="PNG")
    return path


def _text(t, j: int) -> str:
    return t.texts[j] if j < len(t.texts) else str(t.tokens[j])


def canvas_cells(t, top: int = 0) -> list[tuple[int, int, int, int]]:
    """Per token (position order) its cell's box in an animation frame's panel starting at ``top``."""
    order = sorted(range(len(t.positions)), key=lambda j: t.positions[j])
    boxes = [None] * len(order)
    for c, j in enumerate(order):
        x, y = MARGIN + (c % WRAP) * CELL_W, top + LABEL_H + (c // WRAP) * CELL_H
        boxes[j] = (x, y, x + CELL_W - 2, y + CELL_H - 2)
    return boxes


def _panel_height(t) -> int:
    return LABEL_H + max((len(t.tokens) + WRAP - 1) // WRAP, 1) * CELL_H + MARGIN


def render_frames(panels: list[tuple[str, object]]) -> list[Image.Image]:
    """One RGB frame per step (the longest decode's count), every panel as of that step."""
    traces = [t for _, t in panels]
    steps = max((t.num_steps for t in traces), default=0)
    width = MARGIN * 2 + CELL_W * WRAP
    height = sum(_panel_height(t) for t in traces) + MARGIN
    frames, font = [], _font()
    for s in range(steps):
        img = Image.new("RGB", (width, height), WHITE)
        draw, top = ImageDraw.Draw(img), 0
        for label, t in panels:
            now = min(s, t.num_steps - 1)
            done = sum(1 for x in t.steps if x <= now)
            draw.text((MARGIN, top + 4), _label(f"{label}: step {now + 1}/{t.num_steps}, {done}/{len(t.tokens)} "
                                               f"tokens", 120), fill=INK, font=font)
            for j, box in enumerate(canvas_cells(t, top)):
                if t.steps[j] <= now:
                    rgb = step_colour(t.steps[j], t.num_steps)
                    draw.rectangle(box, fill=rgb, outline=(220, 30, 30) if t.steps[j] == now else rgb, width=2)
                    draw.text((box[0] + 3, box[1] + 3), _label(_text(t, j), 6), fill=_text_colour(rgb), font=font)
                else:
                    draw.rectangle(box, fill=MASKED)
            top += _panel_height(t)
        frames.append(img)
    return frames


def render_gif(panels: list[tuple[str, object]], path: Path, ms_per_step: int = 400) -> Path:
    frames = render_frames(panels)
    frames[0].save(path, format="GIF", save_all=True, append_images=frames[1:], duration=ms_per_step, loop=0,
                   optimize=False, disposal=1)
    return path


def _json_for_script(data) -> str:
    """JSON safe inside a <script> element (no '<', '>' or '&' survive: no tag can be closed or opened)."""
    return json.dumps(data).replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


PAGE = (Path(__file__).with_name("decode_view.html")).read_text


def render_html(panels: list[tuple[str, object]], path: Path, title: str = "Decoding") -> Path:
    """A self-contained page (no network requests) animating the panels; everything is rendered as text."""
    data = [{"label": label, **asdict(t)} for label, t in panels]
    page = PAGE().replace("__TITLE__", html.escape(title)).replace("__DATA__", _json_for_script(data))
    Path(path).write_text(page, encoding="utf-8")
    return Path(path)


__all__ = ["render_grid", "render_gif", "render_frames", "render_html", "grid_cells", "canvas_cells", "step_colour"]
