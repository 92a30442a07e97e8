from pyspice.cli.main import main

raise SystemExit(main())
