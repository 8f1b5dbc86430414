from sharpness._cli import main

raise SystemExit(main())
