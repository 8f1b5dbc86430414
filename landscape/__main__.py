from landscape._cli import main

raise SystemExit(main())
