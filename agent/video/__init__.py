"""Video out of the device: results drawn on their frames, MJPEG over HTTP, an encoded stream, snapshots.

Nothing here runs on the frame path beyond a reference kept to the newest frame and its result, and only
while somebody looks (docs/video.md).
"""
