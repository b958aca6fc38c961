"""The automatic decisions of a shadow: cancel when the candidate falls below a floor, promote when
`promote_when` holds. Pure functions of the report's numbers, so a test or an operator can replay them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from agent.shadow.plan import ShadowPlan

DETECTION_KINDS = ("yolo", "anchors", "db_text")
MIN_SERVING_DETECTIONS = 3  # as the gates' MIN_REFERENCE_DETECTIONS: no promotion on frames where nothing was found
MIN_SERVING_DETECTION_RATE = 0.2  # below it the serving model finds too little for a rate ratio to mean anything


@dataclass(frozen=True)
class Verdict:
    """How a shadow ends: `outcome` promoted or cancelled, the reason code and a message with the numbers."""

    outcome: str
    reason: str
    message: str

    def to_dict(self) -> dict[str, str]:
        """The fields of shadow/finished."""
        return {"outcome": self.outcome, "reason": self.reason, "message": self.message}


def judge(plan: ShadowPlan, kind: str, numbers: dict[str, Any], candidate_p99_ms: float | None,
          budget_ms: float | None) -> Verdict | None:
    """A cancel (first) or a promotion due on these numbers; None while the shadow should go on."""
    return _floor(plan, kind, numbers) or _promotion(plan, kind, numbers, candidate_p99_ms, budget_ms)


def _floor(plan: ShadowPlan, kind: str, numbers: dict[str, Any]) -> Verdict | None:
    floor, frames = plan.cancel_below, numbers["frames"]
    if frames < floor.min_frames or numbers["window_frames"] < min(floor.min_frames, plan.window_frames):
        return None  # the window restarts on a serving-model swap: one frame after it is not a verdict
    window = numbers["window_agreement"]
    if floor.agreement > 0 and window is not None and window < floor.agreement:
        return Verdict("cancelled", "SHADOW_AGREEMENT",
                       f"agreement {window:.3f} over the last {numbers['window_frames']} frames is below the floor "
                       f"{floor.agreement:g} (cancel_below.agreement); {frames} frames compared, "
                       f"{_fmt(numbers['agreement'])} in total{stage_note(numbers)}")
    health = numbers.get("health") or {}
    serving = (health.get("serving") or {}).get("detection_rate")
    rate = health.get("detection_rate")
    if (kind in DETECTION_KINDS and floor.detection_rate_ratio > 0 and serving is not None and rate is not None
            and serving >= MIN_SERVING_DETECTION_RATE and rate < floor.detection_rate_ratio * serving):
        return Verdict("cancelled", "SHADOW_HEALTH",
                       f"the candidate finds something on {rate:.1%} of the frames, the serving model on "
                       f"{serving:.1%} of the same frames: below {floor.detection_rate_ratio:g}x "
                       f"(cancel_below.detection_rate_ratio) after {frames} frames")
    return None


def _promotion(plan: ShadowPlan, kind: str, numbers: dict[str, Any], candidate_p99_ms: float | None,
               budget_ms: float | None) -> Verdict | None:
    rule = plan.promote_when
    if rule is None or numbers["frames"] < rule.min_frames:
        return None
    if numbers["window_frames"] < min(rule.min_frames, plan.window_frames) or not has_signal(kind, numbers):
        return None  # an empty scene agrees with everything: wait for frames with something on them
    total, window = numbers["agreement"], numbers["window_agreement"]
    if total is None or window is None or min(total, window) < rule.min_agreement:
        return None
    limit = rule.max_p99_ms if rule.max_p99_ms is not None else budget_ms
    if limit is not None and (candidate_p99_ms is None or candidate_p99_ms > limit):
        return None
    latency = f", candidate p99 {candidate_p99_ms:.2f} ms <= {limit:g} ms" if limit is not None else ""
    return Verdict("promoted", "PROMOTE_WHEN",
                   f"agreement {total:.3f} over {numbers['frames']} frames ({window:.3f} over the last "
                   f"{numbers['window_frames']}) >= {rule.min_agreement:g}{latency}")


def has_signal(kind: str, numbers: dict[str, Any]) -> bool:
    """True when the serving model's results on the compared frames can tell a good candidate from a blind one
    (the live counterpart of the gates' GATE_NO_SIGNAL): objects found, two classes or more, a varied map or
    output. Image outputs always carry a picture."""
    parts, serving = numbers.get("parts") or {}, (numbers.get("health") or {}).get("serving") or {}
    if kind in DETECTION_KINDS:
        return parts.get("serving_detections", 0) >= MIN_SERVING_DETECTIONS
    if kind == "classification":
        return serving.get("classes", 0) >= 2
    if kind == "segmentation":
        return parts.get("serving_varied_frames", 0) >= 1
    if kind == "raw":
        return serving.get("output_spread", 0.0) > 0
    return True


def stage_note(numbers: dict[str, Any]) -> str:
    """A pipeline's weakest judged stage over the window (its end-to-end agreement is the verdict's number, the
    stage says where to look); empty for a single model or before any stage was compared."""
    stages = numbers.get("stages") or {}
    judged = [(name, n.get("window_agreement")) for name, n in stages.items() if n.get("judged")]
    judged = [(name, value) for name, value in judged if value is not None]
    if not judged:
        return ""
    name, value = min(judged, key=lambda item: item[1])
    return f"; the stage agreeing least over the window: {name} ({value:.3f})"


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"
