"""The scenes benchmarks/tracking.py measures on: generated sequences with known ground truth (people and cars that
drift, cross and occlude each other, seen by a detector that misses, jitters and invents boxes) and the scripted
scene whose zone and line counts are known exactly."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import _common  # noqa: F401  (puts the repo on sys.path)
import numpy as np

from agent.tracking import CameraTracking, CameraTrackingConfig, TrackingConfig

SIZE = (1280, 720)
FPS = 30.0
CLASSES = ("person", "car")
Box = tuple[float, float, float, float]


@dataclass
class SceneFrame:
    """One frame: the true boxes by object id, and what the detector reported."""

    gt: list[tuple[int, Box]] = field(default_factory=list)
    dets: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class Actor:
    id: int
    cls: int
    x: float  # centre
    y: float
    w: float
    h: float
    vx: float
    vy: float

    def box(self) -> Box:
        return (self.x - self.w / 2, self.y - self.h / 2, self.x + self.w / 2, self.y + self.h / 2)


def _spawn(rng: np.random.Generator, ident: int, anywhere: bool) -> Actor:
    """A new object: anywhere in the frame at the start, later entering from an edge, heading inwards."""
    cls = int(rng.random() < 0.3)
    w, h = (rng.uniform(80, 140), rng.uniform(50, 90)) if cls else (rng.uniform(30, 60), rng.uniform(80, 150))
    speed, angle = rng.uniform(2, 7), rng.uniform(0, 2 * np.pi)
    x, y = rng.uniform(100, SIZE[0] - 100), rng.uniform(100, SIZE[1] - 100)
    if not anywhere:
        edge = int(rng.integers(4))
        x = (-w / 3, SIZE[0] + w / 3, x, x)[edge]
        y = (y, y, -h / 3, SIZE[1] + h / 3)[edge]
        angle = np.arctan2(SIZE[1] / 2 - y, SIZE[0] / 2 - x) + rng.uniform(-0.6, 0.6)
    return Actor(ident, cls, x, y, w, h, speed * np.cos(angle), speed * np.sin(angle))


def _inside(actor: Actor) -> bool:
    return 0 <= actor.x <= SIZE[0] and 0 <= actor.y <= SIZE[1]


def _visibility(boxes: np.ndarray) -> np.ndarray:
    """Per box, 1 - the largest share of it covered by one nearer box (nearer: its bottom edge lower)."""
    if len(boxes) == 0:
        return np.zeros(0)
    left = np.maximum(boxes[:, None, 0], boxes[None, :, 0])
    top = np.maximum(boxes[:, None, 1], boxes[None, :, 1])
    right = np.minimum(boxes[:, None, 2], boxes[None, :, 2])
    bottom = np.minimum(boxes[:, None, 3], boxes[None, :, 3])
    inter = np.clip(right - left, 0, None) * np.clip(bottom - top, 0, None)
    area = (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])
    nearer = boxes[None, :, 3] > boxes[:, None, 3]
    covered = np.where(nearer, inter / area[:, None], 0.0)
    return 1 - covered.max(axis=1)


def detect(rng: np.random.Generator, gt: Sequence[tuple[int, Box, int]], miss: float, jitter: float,
           false_rate: float) -> list[dict[str, Any]]:
    """What a detector reports for the true boxes: occlusion, misses, jitter, false boxes."""
    boxes = np.array([b for _, b, _ in gt], dtype=np.float64).reshape(-1, 4)
    visible = _visibility(boxes)
    dets = []
    for k, (_, box, cls) in enumerate(gt):
        if visible[k] < 0.35 or rng.random() < miss:
            continue
        score = rng.uniform(0.15, 0.45) if visible[k] < 0.7 else rng.uniform(0.55, 0.95)
        w, h = box[2] - box[0], box[3] - box[1]
        cx, cy = (box[0] + box[2]) / 2 + rng.normal(0, jitter * w), (box[1] + box[3]) / 2 + rng.normal(0, jitter * h)
        w, h = w * (1 + rng.normal(0, jitter)), h * (1 + rng.normal(0, jitter))
        dets.append(_det((cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2), score, cls))
    for _ in range(rng.poisson(false_rate)):
        w, h = rng.uniform(30, 100), rng.uniform(30, 120)
        x, y = rng.uniform(0, SIZE[0] - w), rng.uniform(0, SIZE[1] - h)
        dets.append(_det((x, y, x + w, y + h), rng.uniform(0.1, 0.7), int(rng.integers(2))))
    return dets


def _det(box: Box, score: float, cls: int) -> dict[str, Any]:
    x1, y1 = max(0.0, box[0]), max(0.0, box[1])
    x2, y2 = min(float(SIZE[0]), box[2]), min(float(SIZE[1]), box[3])
    return {"box": [x1, y1, max(x2, x1 + 1), max(y2, y1 + 1)], "score": float(score), "class_id": cls,
            "label": CLASSES[cls]}


def generate(seed: int, frames: int, objects: int, miss: float = 0.1, jitter: float = 0.03,
             false_rate: float = 0.3) -> list[SceneFrame]:
    """A sequence with `objects` in view at any time (one that leaves is replaced by a new one)."""
    rng = np.random.default_rng(seed)
    actors = [_spawn(rng, k, anywhere=True) for k in range(objects)]
    next_id = objects
    scene = []
    for _ in range(frames):
        for actor in actors:
            actor.vx += rng.normal(0, 0.15)
            actor.vy += rng.normal(0, 0.15)
            actor.x += actor.vx
            actor.y += actor.vy
        for k, actor in enumerate(actors):
            gone = abs(actor.x - SIZE[0] / 2) > SIZE[0] / 2 + actor.w / 4 or \
                abs(actor.y - SIZE[1] / 2) > SIZE[1] / 2 + actor.h / 4
            if gone:
                actors[k] = _spawn(rng, next_id, anywhere=False)
                next_id += 1
        gt = [(a.id, a.box(), a.cls) for a in actors if _inside(a)]
        scene.append(SceneFrame([(i, b) for i, b, _ in gt], detect(rng, gt, miss, jitter, false_rate)))
    return scene


# --- scripted counts -----------------------------------------------------------------------------------------------

LINE = ((200.0, 400.0), (1100.0, 400.0))  # drawn left to right: moving down the image is "in"
ZONE = [(150.0, 480.0), (550.0, 480.0), (550.0, 700.0), (150.0, 700.0)]
# bottom-centre waypoints (frame, x, y) per actor, class; between waypoints the actor moves in a straight line
SCRIPT: list[tuple[int, list[tuple[int, float, float]]]] = [
    (0, [(0, 300, 250), (100, 300, 650), (180, 300, 650), (230, 60, 650)]),  # down, into the zone, dwells, leaves
    (0, [(10, 700, 200), (120, 700, 650), (160, 700, 720)]),  # down across the line
    (0, [(20, 900, 650), (140, 900, 150)]),  # up across the line
    (1, [(30, 500, 150), (150, 450, 600), (200, 800, 600)]),  # a car down across the line, through the zone's corner
    (0, [(0, 100, 380), (200, 1200, 380)]),  # along the line, 20 px above it: no crossing
    (0, [(40, 1200, 200), (160, 1200, 600)]),  # down past the line's end: no crossing
    (0, [(60, 400, 600), (180, 400, 200)]),  # starts in the zone, leaves it and crosses up
]
EXPECTED = {"lines": {"door": {"in": {"person": 2, "car": 1}, "out": {"person": 2}}},
            "zones": {"yard": {"entered": {"person": 2, "car": 1}, "left": {"person": 2, "car": 1}, "inside": {},
                               "dwelled": {"person": 1}}}}
SCRIPT_FRAMES = 240


def _at(waypoints: list[tuple[int, float, float]], frame: int) -> tuple[float, float] | None:
    for (f0, x0, y0), (f1, x1, y1) in zip(waypoints, waypoints[1:]):
        if f0 <= frame <= f1:
            t = (frame - f0) / (f1 - f0)
            return x0 + t * (x1 - x0), y0 + t * (y1 - y0)
    return None


def scripted_scene(seed: int = 0, miss: float = 0.1) -> list[SceneFrame]:
    """The script as frames: people 50x120, the car 120x80, placed by their bottom centre."""
    rng = np.random.default_rng(seed)
    scene = []
    for frame in range(SCRIPT_FRAMES):
        gt = []
        for ident, (cls, waypoints) in enumerate(SCRIPT):
            where = _at(waypoints, frame)
            if where is not None:
                w, h = (120.0, 80.0) if cls else (50.0, 120.0)
                gt.append((ident, (where[0] - w / 2, where[1] - h, where[0] + w / 2, where[1]), cls))
        scene.append(SceneFrame([(i, b) for i, b, _ in gt], detect(rng, gt, miss, 0.03, 0.3)))
    return scene


def scripted_config() -> TrackingConfig:
    """[tracking] for the script: one camera with the line `door` and the zone `yard` (dwell 2 s)."""
    return TrackingConfig(enabled=True, cameras=[CameraTrackingConfig(
        camera="cam0", zones=[{"name": "yard", "polygon": ZONE, "dwell_s": 2.0}],
        lines=[{"name": "door", "points": LINE}])])


def scripted_counts(seed: int = 0) -> dict[str, Any]:
    """Run the script through the agent's camera state: counts, and whether they equal the script's."""
    config = scripted_config()
    camera = CameraTracking("cam0", config.params("cam0"), config.camera("cam0"))
    for k, frame in enumerate(scripted_scene(seed)):
        camera.update(frame.dets, k / FPS, SIZE)
    got = camera.counts()
    got.pop("track_epoch")
    return {"exact": got == EXPECTED, "expected": EXPECTED, "got": got}
