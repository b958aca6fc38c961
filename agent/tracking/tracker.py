"""ByteTrack over one camera's detections: Kalman prediction, then association in three stages by score.

1. High detections (score >= high_score) against every confirmed and lost track, on IoU with the predicted box
   (times the score with fuse_score), gated at match_iou.
2. Low detections (low_score <= score < high_score) against the confirmed tracks stage 1 left, gated at
   low_match_iou: a partly hidden or blurred object scores low, and this keeps its id where a one-stage tracker
   (SORT) would drop the box and the track with it.
3. Tentative tracks against the high detections still free, gated at tentative_match_iou.
A high detection nobody took, scoring at least new_track_score, starts a tentative track; min_hits matches in a row
confirm it and give it the camera's next id. A confirmed track without a match is lost (box predicted) and ends
after max_age frames; a tentative one without a match ends at once. With class_aware, a pair of different classes
is never matched. Each stage is a maximum-weight matching (agent.tracking.assignment), as ByteTrack's LAPJV is.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Hashable, Sequence

import numpy as np

from agent.tracking import kalman
from agent.tracking.assignment import assign, iou_matrix
from agent.tracking.config import TrackerParams

TENTATIVE, CONFIRMED, LOST = "tentative", "confirmed", "lost"
ClassKey = Hashable  # a label, or a class id for a model without labels; None: unknown (matches any class)


@dataclass(eq=False)
class TrackRecord:
    """One track's bookkeeping (the Kalman state lives in the tracker's arrays, row for row)."""

    class_key: ClassKey
    class_id: int | None
    label: str | None
    score: float
    state: str = TENTATIVE
    track_id: int | None = None  # given when confirmed
    age: int = 1  # frames since it started, this one included
    hits: int = 1  # frames it was matched in
    streak: int = 1  # matches in a row
    misses: int = 0  # frames since its last match
    detection: int = -1  # index of this frame's detection it took, -1 for none
    trail: deque = field(default_factory=deque)
    trail_view: tuple = ()  # tuple(trail), rebuilt only when the trail grows (views share it between frames)

    def add_point(self, point: tuple[float, float]) -> None:
        """Append an observed centre to the trail (and refresh its tuple)."""
        self.trail.append(point)
        self.trail_view = tuple(self.trail)


@dataclass
class Detections:
    """One frame's detections as arrays (agent.tracking.camera builds them from the result)."""

    boxes: np.ndarray  # (N, 4) x1, y1, x2, y2 in frame pixels
    scores: np.ndarray  # (N,)
    class_keys: list[ClassKey]
    class_ids: list[int | None]
    labels: list[str | None]

    @classmethod
    def empty(cls) -> "Detections":
        """No detection."""
        return cls(np.zeros((0, 4)), np.zeros(0), [], [], [])


@dataclass
class Step:
    """What one update did: the live tracks with their boxes, and the tracks that ended."""

    tracks: list[TrackRecord]
    boxes: np.ndarray  # (T, 4), row per track: the corrected box when matched, else the predicted one
    ended: list[TrackRecord]


class ByteTracker:
    """Tracks of one camera; `step` once per frame (not thread-safe: agent.tracking.camera locks around it)."""

    def __init__(self, params: TrackerParams) -> None:
        self.params = params
        self._tracks: list[TrackRecord] = []
        self._mean = np.zeros((0, 8))
        self._cov = np.zeros((0, 3, 4))
        self._next_id = 1

    @property
    def tracks(self) -> list[TrackRecord]:
        """The live tracks (tentative, confirmed, lost)."""
        return list(self._tracks)

    def boxes(self) -> np.ndarray:
        """(T, 4) current boxes of the live tracks."""
        return kalman.xyah_to_boxes(self._mean)

    def step(self, dets: Detections, dt: float = 1.0) -> Step:
        """Advance `dt` frames and take this frame's detections."""
        p = self.params
        self._predict(dt)
        predicted = kalman.xyah_to_boxes(self._mean)
        scores = dets.scores
        high = np.flatnonzero(scores >= p.high_score)
        low = np.flatnonzero((scores >= p.low_score) & (scores < p.high_score))
        states = [t.state for t in self._tracks]
        pool = [i for i, s in enumerate(states) if s != TENTATIVE]
        tentative = [i for i, s in enumerate(states) if s == TENTATIVE]
        # every track against every detection, once: each stage takes its rows and columns out of these
        iou = iou_matrix(predicted, dets.boxes) if len(states) and len(scores) else None
        if iou is not None and p.class_aware:
            iou = np.where(self._same_class([t.class_key for t in self._tracks], dets.class_keys), iou, 0.0)
        first, pool_left, high_left = self._match(pool, high, iou, dets, p.match_iou, p.fuse_score)
        second, _, _ = self._match([pool[i] for i in pool_left], low, iou, dets, p.low_match_iou, False)
        free_high = high[high_left]
        third, _, unclaimed = self._match(tentative, free_high, iou, dets, p.tentative_match_iou, p.fuse_score)
        self._correct(first + second + third, dets)
        ended = self._age_unmatched()
        self._start(free_high[unclaimed], dets)
        return Step(list(self._tracks), kalman.xyah_to_boxes(self._mean), ended)

    def _predict(self, dt: float) -> None:
        for track in self._tracks:
            track.detection = -1
            track.age += 1
        if not self._tracks:
            return
        lost = np.array([t.state == LOST for t in self._tracks])
        self._mean[lost, 7] = 0.0  # a lost box keeps its size (ByteTrack)
        self._mean, self._cov = kalman.predict(self._mean, self._cov, dt)

    def _match(self, rows: Sequence[int], cols: np.ndarray, iou: np.ndarray | None, dets: Detections,
               threshold: float, fuse: bool) -> tuple[list[tuple[int, int]], list[int], list[int]]:
        """Matches (track row, detection index), and the positions in `rows` and `cols` left unmatched. `iou`: every
        track's predicted box against every detection (zero across classes when class_aware)."""
        if len(rows) == 0 or len(cols) == 0 or iou is None:
            return [], list(range(len(rows))), list(range(len(cols)))
        similarity = iou[np.asarray(rows)[:, None], cols]
        if fuse:
            similarity = similarity * dets.scores[cols][None, :]
        weights = np.where(similarity >= threshold, similarity - threshold + 1e-9, 0.0)
        pairs, rows_left, cols_left = assign(weights)
        return [(rows[r], int(cols[c])) for r, c in pairs], rows_left, cols_left

    @staticmethod
    def _same_class(tracks: list[ClassKey], dets: list[ClassKey]) -> np.ndarray:
        codes: dict[ClassKey, int] = {}
        t = np.array([-1 if k is None else codes.setdefault(k, len(codes)) for k in tracks])
        d = np.array([-1 if k is None else codes.setdefault(k, len(codes)) for k in dets])
        return (t[:, None] == d[None, :]) | (t[:, None] < 0) | (d[None, :] < 0)

    def _correct(self, pairs: list[tuple[int, int]], dets: Detections) -> None:
        if not pairs:
            return
        rows, cols = np.array(pairs, dtype=np.int64).T
        measured = kalman.boxes_to_xyah(dets.boxes[cols])
        self._mean[rows], self._cov[rows] = kalman.update(self._mean[rows], self._cov[rows], measured)
        for row, col in pairs:
            self._take(self._tracks[row], col, dets)

    def _take(self, track: TrackRecord, col: int, dets: Detections) -> None:
        """Book-keeping of a track that matched detection `col` this frame."""
        track.detection = col
        track.score = float(dets.scores[col])
        track.hits += 1
        track.streak = track.streak + 1 if track.misses == 0 else 1
        track.misses = 0
        if track.class_key is None or not self.params.class_aware:
            track.class_key, track.class_id, track.label = dets.class_keys[col], dets.class_ids[col], dets.labels[col]
        if track.state == LOST:
            track.state = CONFIRMED
        elif track.state == TENTATIVE and track.streak >= self.params.min_hits:
            self._confirm(track)

    def _confirm(self, track: TrackRecord) -> None:
        track.state = CONFIRMED
        track.track_id = self._next_id
        self._next_id += 1

    def _age_unmatched(self) -> list[TrackRecord]:
        """Unmatched confirmed tracks are lost; tentative ones and those lost too long end. Returns the ended."""
        keep, ended = [], []
        for row, track in enumerate(self._tracks):
            if track.detection < 0:
                track.misses += 1
                if track.state == CONFIRMED:
                    track.state = LOST
                if track.state == TENTATIVE or track.misses > self.params.max_age:
                    ended.append(track)
                    continue
            keep.append(row)
        if ended:
            self._tracks = [self._tracks[r] for r in keep]
            self._mean, self._cov = self._mean[keep], self._cov[keep]
        return ended

    def _start(self, cols: np.ndarray, dets: Detections) -> None:
        cols = cols[dets.scores[cols] >= self.params.new_track_score]
        if len(cols) == 0:
            return
        mean, cov = kalman.initiate(kalman.boxes_to_xyah(dets.boxes[cols]))
        self._mean = np.concatenate([self._mean, mean])
        self._cov = np.concatenate([self._cov, cov])
        for col in cols.tolist():
            track = TrackRecord(dets.class_keys[col], dets.class_ids[col], dets.labels[col], float(dets.scores[col]),
                                detection=col, trail=deque(maxlen=self.params.trail_length))
            self._tracks.append(track)
            if self.params.min_hits <= 1:
                self._confirm(track)

    def end_all(self) -> list[TrackRecord]:
        """Drop every track (a camera reset); ids start again at 1. Returns the tracks that were live."""
        ended, self._tracks = self._tracks, []
        self._mean, self._cov = np.zeros((0, 8)), np.zeros((0, 3, 4))
        self._next_id = 1
        return ended
