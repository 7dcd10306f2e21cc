"""What `qmq admin` and `qmq console` show, shared by both: the servers' answers (from the client's
administration calls, `qmq.client.admin`) made into rows a person reads (`views`), and a message's
rows in the application's database (`database`). The command line prints them as tables or JSON, the
console renders them as pages.
"""
