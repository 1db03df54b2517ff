"""The pictures of decoding (setdiff_mega/eval/decode_view.py, issue 40), checked by content: the PNG grid has
one coloured cell per generated token, at (its commit step, its position), and nothing else coloured in the
grid; the GIF has one frame per step, each with the tokens committed so far coloured and the rest grey; the
HTML page embeds the traces so that no text can become markup."""
import json
import re

from PIL import Image

from setdiff_mega.decoding.trace import DecodeTrace
from setdiff_mega.eval.decode_view import (
    CELL_H,
    CELL_W,
    MASKED,
    WHITE,
    canvas_cells,
    grid_cells,
    render_gif,
    render_grid,
    render_html,
)

EVIL = "<script>alert(1)</script>"


def _trace(method="setdlm", steps=(0, 0, 1, 2, 1, 3, 3, 4), texts=None):
    n = len(steps)
    return DecodeTrace(method=method, prompt=[1, 2] + [9] * n, positions=list(range(2, 2 + n)),
                       tokens=list(range(10, 10 + n)), steps=list(steps), confidences=[0.5] * n,
                       window=[2] * n, texts=texts or [f"t{i}" for i in range(n)])


def _centre(box):
    return (box[0] + box[2]) // 2, box[1] + 2          # above the text: the cell's fill


def test_the_grid_has_one_coloured_cell_per_token_at_its_step_and_position(tmp_path):
    panels = [("setdlm", _trace()), ("ar", _trace("ar", steps=tuple(range(6))))]
    img = Image.open(render_grid(panels, tmp_path / "g.png")).convert("RGB")
    for (_, t), cells in zip(panels, grid_cells([t for _, t in panels])):
        assert len(cells) == len(t.tokens)
        coloured = {(b[0], b[1]) for b in cells}
        for b in cells:
            assert img.getpixel(_centre(b)) != WHITE
        x0, y0 = min(b[0] for b in cells), min(b[1] for b in cells)
        empty = 0
        for r in range(t.num_steps):                  # every other cell of the panel's grid stays white
            for c in range(len(t.tokens)):
                box = (x0 + c * CELL_W, y0 + r * CELL_H, x0 + (c + 1) * CELL_W - 2, y0 + (r + 1) * CELL_H - 2)
                if (box[0], box[1]) not in coloured:
                    assert img.getpixel(_centre(box)) == WHITE, (r, c)
                    empty += 1
        assert empty == t.num_steps * len(t.tokens) - len(t.tokens)
    # colour follows the step: two tokens of one step share it, tokens of different steps do not
    cells = grid_cells([panels[0][1]])[0]
    assert img.getpixel(_centre(cells[0])) == img.getpixel(_centre(cells[1]))
    assert img.getpixel(_centre(cells[0])) != img.getpixel(_centre(cells[2]))


def test_the_animation_has_a_frame_per_step_filling_in_the_canvas(tmp_path):
    t = _trace()
    gif = Image.open(render_gif([("setdlm", t)], tmp_path / "a.gif"))
    assert gif.n_frames == t.num_steps == 5
    for s in range(gif.n_frames):
        gif.seek(s)
        frame = gif.convert("RGB")
        for j, box in enumerate(canvas_cells(t)):
            px = frame.getpixel(((box[0] + box[2]) // 2, box[1] + 1 + (box[3] - box[1]) // 2 - 6))
            assert (px != MASKED) == (t.steps[j] <= s), (s, j, px)


def test_the_page_embeds_the_traces_as_data_and_never_as_markup(tmp_path):
    t = _trace(texts=[EVIL, "a&b", "</script><b>x</b>", "ok", "\u00e9", "x", "y", "z"])
    page = render_html([(EVIL, t)], tmp_path / "p.html", title=EVIL).read_text()
    assert EVIL not in page and "</script><b>" not in page and "<b>x</b>" not in page
    blob = re.search(r'<script type="application/json" id="trace-data">(.*?)</script>', page, re.S).group(1)
    data = json.loads(blob)
    assert data[0]["label"] == EVIL and data[0]["texts"][0] == EVIL and data[0]["texts"][2] == "</script><b>x</b>"
    assert DecodeTrace(**{k: v for k, v in data[0].items() if k != "label"}) == t
    assert "http://" not in page and "https://" not in page and "src=" not in page     # loads nothing
    assert "innerHTML" not in page
