import sys

# Guarded: a worker process of `study --jobs N` (spawned) imports this module again under another name, and must
# not run the command line a second time.
if __name__ == "__main__":
    try:  # Ctrl-C while torch is still being imported is an interruption too, not a traceback
        from sharpness._cli import main
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        raise SystemExit(130) from None

    raise SystemExit(main())
