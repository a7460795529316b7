"""The site's power tree above the rows: domains, feeds, live capacity, allocation (pure).

``model.py`` reads and checks a site file's tree; ``capacity.py`` says what each domain
can carry with the feeds that are up; ``allocate.py`` shares each domain's capacity among
what it supplies, by priority.
"""
