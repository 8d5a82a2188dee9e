import sys

from app.gui.app import main

sys.exit(main())
