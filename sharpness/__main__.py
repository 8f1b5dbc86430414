import sys

try:  # Ctrl-C while torch is still being imported is an interruption too, not a traceback
    from sharpness._cli import main
except KeyboardInterrupt:
    print("interrupted", file=sys.stderr)
    raise SystemExit(130) from None

raise SystemExit(main())
